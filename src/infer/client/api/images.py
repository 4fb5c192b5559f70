"""The images of a chat request's `image_url` parts, as encoded bytes for the engine (torch-free, Pillow-free: the
worker decodes and checks the pixels, worker/engine/images.py). Every refusal is an ApiError 400 naming the part.

- `data:image/...;base64,...`: decoded here, its size bounded before decoding (MAX_IMAGE_BYTES);
- `http://` / `https://`: refused; this server fetches nothing from the network (a cluster node may have none);
- `file://PATH`: only under the directory of `--allowed-local-media-path` (vLLM's flag), resolved (links and `..`
  followed) before the check, read up to MAX_IMAGE_BYTES.
"""

from __future__ import annotations

import base64
import binascii
import os
from pathlib import Path
from urllib.parse import unquote, urlsplit

from infer.client.api.schemas import ApiError
from infer.protocol.messages import MAX_IMAGE_BYTES, MAX_IMAGES, MAX_REQUEST_IMAGE_BYTES


def image_bytes_of(urls: list[str], allowed_dir: Path | None) -> list[bytes]:
    """The images of `urls` (in order); ApiError 400 for the first that is refused."""
    if len(urls) > MAX_IMAGES:
        raise ApiError(
            400, f"messages: {len(urls)} images exceed the limit of {MAX_IMAGES} per request", param="messages"
        )
    images = [_image(url, allowed_dir, f"messages: image {i}") for i, url in enumerate(urls)]
    total = sum(map(len, images))
    if total > MAX_REQUEST_IMAGE_BYTES:
        raise ApiError(
            400,
            f"messages: the images hold {total} bytes, more than {MAX_REQUEST_IMAGE_BYTES} a request",
            param="messages",
        )
    return images


def _image(url: str, allowed_dir: Path | None, where: str) -> bytes:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url(url, where)
    if scheme in ("http", "https"):
        raise ApiError(
            400,
            f"{where}: {scheme} URLs are not fetched (this server reaches no network); send the image inline as a "
            "base64 data: URL",
            param="messages",
        )
    if scheme == "file":
        return _local_file(url, allowed_dir, where)
    raise ApiError(400, f"{where}: unsupported URL scheme {scheme[:20]!r}; use a base64 data: URL", param="messages")


def _data_url(url: str, where: str) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise ApiError(400, f"{where}: a data: URL needs ',' before its data", param="messages")
    media, _, encoding = header[len("data:") :].rpartition(";")
    if encoding.lower() != "base64":
        raise ApiError(
            400, f"{where}: only base64 data: URLs are supported (data:image/...;base64,...)", param="messages"
        )
    if media and not media.lower().startswith("image/"):
        raise ApiError(400, f"{where}: media type {media[:60]!r} is not an image", param="messages")
    if len(payload) > (MAX_IMAGE_BYTES + 2) // 3 * 4:
        raise ApiError(400, f"{where}: more than the limit of {MAX_IMAGE_BYTES} bytes per image", param="messages")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise ApiError(400, f"{where}: the data: URL's data is not valid base64", param="messages") from None


def _local_file(url: str, allowed_dir: Path | None, where: str) -> bytes:
    if allowed_dir is None:
        raise ApiError(
            400,
            f"{where}: file: URLs are refused unless the server runs with --allowed-local-media-path",
            param="messages",
        )
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ApiError(400, f"{where}: a file: URL names no other host", param="messages")
    path = Path(os.path.realpath(unquote(parts.path)))
    root = Path(os.path.realpath(allowed_dir))
    if not path.is_relative_to(root):
        raise ApiError(400, f"{where}: the file is outside --allowed-local-media-path", param="messages")
    if path.exists() and not path.is_file():  # a FIFO or a device would block the read or never end
        raise ApiError(400, f"{where}: the file: URL names no regular file", param="messages")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_IMAGE_BYTES + 1)
    except OSError as error:
        raise ApiError(400, f"{where}: cannot read the file ({error.strerror})", param="messages") from None
    if len(data) > MAX_IMAGE_BYTES:
        raise ApiError(400, f"{where}: more than the limit of {MAX_IMAGE_BYTES} bytes per image", param="messages")
    return data
