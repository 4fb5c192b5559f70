"""LLaVA-NeXT's any-resolution layout, torch-free: which grid of tiles an image is cut into, and how many tokens it
makes, as transformers' LlavaNextImageProcessor, LlavaNextProcessor and LlavaNextForConditionalGeneration compute
them. Sizes are (height, width) throughout.

- `select_best_resolution`: of the checkpoint's `image_grid_pinpoints`, the one that keeps most of the image's pixels
  when the image is scaled into it (ties: the one that wastes least);
- `fitted_size`: the size the image is resized to inside that resolution, its aspect ratio kept (the rest is padding,
  split evenly: the odd pixel after);
- `unpadded_crop`: the part of the grid's feature map that holds the image and not the padding (`unpad_image`);
- `AnyresLayout.token_count`: the whole image's tile (one tile's features), then the kept feature rows, each followed
  by the `image_newline` vector.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


def select_best_resolution(height: int, width: int, resolutions: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """transformers' select_best_resolution (an image so thin that it keeps no pixel in any resolution takes the first
    of those that waste least, as there); ValueError for no resolutions."""
    best: tuple[int, int] | None = None
    best_effective, best_wasted = 0, math.inf
    for res_height, res_width in resolutions:
        scale = min(res_width / width, res_height / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        wasted = res_width * res_height - effective
        if effective > best_effective or (effective == best_effective and wasted < best_wasted):
            best, best_effective, best_wasted = (res_height, res_width), effective, wasted
    if best is None:
        raise ValueError("no grid resolutions (image_grid_pinpoints is empty)")
    return best


def fitted_size(height: int, width: int, target: tuple[int, int]) -> tuple[int, int]:
    """transformers' get_patch_output_size: the image scaled to fit `target`, one side filling it."""
    target_height, target_width = target
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return min(math.ceil(height * scale_w), target_height), target_width
    return target_height, min(math.ceil(width * scale_h), target_width)


def unpadded_crop(height: int, width: int, rows: int, cols: int) -> tuple[int, int, int, int]:
    """(top, kept rows, left, kept columns) of a rows x cols feature map of an image of `height` x `width` pixels
    padded into it, as transformers' unpad_image crops it (the padding of the side the image does not fill, taken
    off both ends: an odd remainder stays)."""
    if width / height > cols / rows:
        new_height = int(round(height * (cols / width), 7))
        padding = (rows - new_height) // 2
        return padding, rows - 2 * padding, 0, cols
    new_width = int(round(width * (rows / height), 7))
    padding = (cols - new_width) // 2
    return 0, rows, padding, cols - 2 * padding


@dataclass(frozen=True)
class AnyresLayout:
    """A LLaVA-NeXT checkpoint's tiling: tiles of `tile` pixels square (the vision tower's image_size), each `side` x
    `side` features after the tower (image_size // patch_size, the class token dropped), and the grid resolutions
    `pinpoints` ((height, width) in pixels, multiples of `tile`)."""

    tile: int
    side: int
    pinpoints: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        if self.tile < 1 or self.side < 1:
            raise ValueError(f"tile {self.tile} and side {self.side} must be positive")
        if not self.pinpoints:
            raise ValueError("image_grid_pinpoints is empty")
        for height, width in self.pinpoints:
            if height < self.tile or width < self.tile or height % self.tile or width % self.tile:
                raise ValueError(
                    f"image_grid_pinpoints {[list(p) for p in self.pinpoints]}: each must be a multiple of the "
                    f"vision tower's image_size {self.tile}, got ({height}, {width})"
                )

    @classmethod
    def of(cls, tile: int, side: int, pinpoints: object) -> AnyresLayout:
        """From config values (pinpoints as a list of [height, width] lists); ValueError naming a malformed one."""
        if not isinstance(pinpoints, (list, tuple)) or not all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(isinstance(v, int) for v in p) for p in pinpoints
        ):
            raise ValueError(f"image_grid_pinpoints must be a list of [height, width] pairs, got {pinpoints!r}")
        return cls(tile, side, tuple((int(h), int(w)) for h, w in pinpoints))

    def best_resolution(self, height: int, width: int) -> tuple[int, int]:
        """The grid resolution (height, width) in pixels for an image of that size."""
        return select_best_resolution(height, width, self.pinpoints)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """(rows, columns) of tiles for an image of that size."""
        best_height, best_width = self.best_resolution(height, width)
        return best_height // self.tile, best_width // self.tile

    def kept_features(self, height: int, width: int) -> tuple[int, int, int, int]:
        """(top, rows, left, columns) of the grid's feature map that the image's tokens hold (`unpadded_crop`)."""
        rows, cols = self.grid(height, width)
        return unpadded_crop(height, width, rows * self.side, cols * self.side)

    def token_count(self, height: int, width: int) -> int:
        """An image's tokens: its whole-image tile's features, then each kept feature row and its newline."""
        _, rows, _, cols = self.kept_features(height, width)
        return self.side * self.side + rows * (cols + 1)
