"""Options declared once: command-line flags built from config dataclasses, parsed flags turned back into
configs, and configs turned into argv for launchers. No I/O.

A config field says what its flag needs in its metadata (`option(...)`): the help text, and where the flag is
not just the field's name dashed, its flag; `cli=False` keeps a field off the command line. Its type comes from
the annotation: `bool` is an `--x / --no-x` pair, `int | None` takes an int, and so on; `choices` come from
the metadata. Flags are added with default None, so only the flags given override the config's own defaults
(`given`; a launcher reading its own options as parsed asks for the fields' defaults instead), and `to_argv`
writes back the fields that differ from those defaults: the one path from a config to another process's command
line (infer-serve's workers, LLM's local cluster, the Slurm launcher).

vLLM's spellings, declared here once for every command: `VLLM_ALIASES` are other names of our flags with the
same meaning (`add_options` adds them, and `flag_names` gives them to the few flags declared by hand, such as
infer-serve's --workers); `VLLM_REFUSED` are vLLM flags we have no equivalent for, or take only at the values
that mean what we do (`add_vllm_flags`): any other use stops the command with the reason and what to use
instead, never a flag silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# our flag -> vLLM's names for it (the same meaning)
VLLM_ALIASES: dict[str, tuple[str, ...]] = {
    "--tp-size": ("--tensor-parallel-size", "-tp"),  # processes per DP rank (a TP group)
    "--pp-size": ("--pipeline-parallel-size", "-pp"),  # pipeline stages per DP rank
    "--workers": ("--data-parallel-size", "-dp"),  # infer-serve: DP ranks
    "--kv-cache-memory": ("--kv-cache-memory-bytes",),  # bytes of KV cache per DP rank
    "--kv-offload-host-gb": ("--kv-offloading-size",),  # GiB of host memory for evicted KV blocks per DP rank
}


@dataclasses.dataclass(frozen=True)
class Refused:
    """A vLLM flag without an equivalent here: `accepted` values (as given on the command line) mean what we do
    anyway and pass; `switch`: the flag takes no value (accepted: True when giving it means what we do)."""

    reason: str
    accepted: tuple[str, ...] = ()
    switch: bool = False
    aliases: tuple[str, ...] = ()


VLLM_REFUSED: dict[str, Refused] = {
    "--kv-cache-dtype": Refused(
        "the KV cache is kept in the model's dtype (--dtype); only 'auto' is implemented", accepted=("auto",)
    ),
    "--gpu-memory-utilization": Refused(
        "infer does not size memory as a share of the whole GPU: give the KV pool in bytes (--kv-cache-memory, vLLM's "
        "--kv-cache-memory-bytes) or as a share of the memory free once the weights are loaded "
        "(--kv-cache-memory-fraction)"
    ),
    "--swap-space": Refused(
        "preemption recomputes here; there is no CPU swap space for KV blocks (evicted prefix-cache blocks can go to "
        "host memory: --kv-offload-host-gb N, and to disk: --kv-offload-dir DIR --kv-offload-gb N)"
    ),
    "--cpu-offload-gb": Refused(
        "weights are not offloaded to CPU memory; use --quantization int8 / int4 to fit a model in less memory"
    ),
    "--enable-expert-parallel": Refused(
        "give the EP group's size instead: --ep-size N (experts sharded over N ranks)", switch=True
    ),
    "--enable-auto-tool-choice": Refused("", switch=True, accepted=("on",)),  # always on here: tool_choice auto
}


def flag_names(flag: str) -> list[str]:
    """`flag` and vLLM's aliases of it (VLLM_ALIASES)."""
    return [flag, *VLLM_ALIASES.get(flag, ())]


class _RefusedFlag(argparse.Action):
    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        refused = VLLM_REFUSED[self.option_strings[0]]
        given_value = "on" if refused.switch else values
        if given_value in refused.accepted:
            return
        shown = option_string if refused.switch else f"{option_string} {values}"
        parser.error(f"{shown}: not supported by infer: {refused.reason}")


def add_vllm_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of VLLM_REFUSED that `parser` does not define: each refused with its reason (module doc)."""
    group = parser.add_argument_group(
        "vLLM's flags without an equivalent (refused with the reason, but for the values that mean what infer does)"
    )
    for flag, refused in VLLM_REFUSED.items():
        kwargs: dict[str, Any] = {"nargs": 0} if refused.switch else {"metavar": "|".join(refused.accepted) or "X"}
        try:
            group.add_argument(
                flag,
                *refused.aliases,
                action=_RefusedFlag,
                dest=argparse.SUPPRESS,
                default=argparse.SUPPRESS,
                help=("accepted: " + ", ".join(refused.accepted)) if refused.accepted else "refused",
                **kwargs,
            )
        except argparse.ArgumentError:  # the command has a flag of that name: its own meaning wins
            continue


class _Extend(argparse.Action):
    """A flag of several values that may also be given several times: `--x A --x B` is `--x A B` (the default, when
    the flag is given, is replaced, not added to)."""

    def __call__(self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None) -> None:
        current = getattr(namespace, self.dest, None)
        given = [] if current is None or current is self.default else list(current)
        setattr(namespace, self.dest, [*given, *values])


def option(
    default: Any = dataclasses.MISSING,
    help: str = "",
    *,
    flag: str | None = None,  # noqa: A002
    metavar: str | None = None,
    choices: Sequence[str] | None = None,
    cli: bool = True,
    default_factory: Any = dataclasses.MISSING,
    parse: Any = None,
    show: Any = None,
) -> Any:
    """A dataclass field with what its command-line flag needs (see the module doc). `parse`: turns the flag's
    text into the value where the annotated type cannot (its ValueError's message becomes the flag's error);
    `to_argv` writes such a value back with `str()`. `show`: the field is a sequence given as several values after
    one flag (`--x A B`), each parsed by `parse` and written back by `show(element)`."""
    metadata = {
        "help": help,
        "flag": flag,
        "metavar": metavar,
        "choices": choices,
        "cli": cli,
        "parse": parse,
        "show": show,
    }
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def flag_of(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def cli_fields(cls: type, names: Iterable[str] | None = None, exclude: Iterable[str] = ()) -> list[dataclasses.Field]:
    """`cls`'s fields that have flags, in declaration order (only `names`, when given; never `exclude`)."""
    wanted = None if names is None else set(names)
    skip = set(exclude)
    return [
        f
        for f in dataclasses.fields(cls)
        if f.metadata.get("cli", True) and f.name not in skip and (wanted is None or f.name in wanted)
    ]


def _scalar_type(cls: type, f: dataclasses.Field) -> type:
    """The flag's value type: the annotation without its `| None`."""
    hint = typing.get_type_hints(cls)[f.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(options) != 1:
            raise TypeError(f"{cls.__name__}.{f.name}: a flag needs one type, got {hint}")
        hint = options[0]
    return hint


def _default_text(f: dataclasses.Field) -> str:
    if f.default is dataclasses.MISSING or f.default is None:
        return ""
    if isinstance(f.default, bool):
        return f" (default: {'on' if f.default else 'off'})"
    return f" (default {f.default})"


def add_options(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    names: Iterable[str] | None = None,
    exclude: Iterable[str] = (),
    *,
    defaults: bool = False,
) -> None:
    """One flag per field of `cls` (see the module doc), with default None: an omitted flag leaves the field to
    the config's default. `defaults`: the flags default to the fields' defaults instead, for a command that reads
    its own options from the parsed args as they are (a launcher; nothing else fills in its defaults)."""
    for f in cli_fields(cls, names, exclude):
        kind = _scalar_type(cls, f)
        help_text = (f.metadata.get("help") or "") + _default_text(f)
        default = f.default if defaults and f.default is not dataclasses.MISSING else None
        kwargs: dict[str, Any] = {"dest": f.name, "default": default, "help": help_text or None}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _parser(f.metadata["parse"]) if f.metadata.get("parse") else kind
            if f.metadata.get("choices"):
                kwargs["choices"] = tuple(f.metadata["choices"])
            if f.metadata.get("metavar"):
                kwargs["metavar"] = f.metadata["metavar"]
            if f.metadata.get("show"):
                kwargs["nargs"], kwargs["action"] = "+", _Extend
        parser.add_argument(*flag_names(flag_of(f)), **kwargs)


def _parser(parse: Any) -> Any:
    """`parse` for argparse: its ValueError's message becomes the flag's error message."""

    def run(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return run


def given(
    cls: type, args: argparse.Namespace, names: Iterable[str] | None = None, exclude: Iterable[str] = ()
) -> dict[str, Any]:
    """The fields of `cls` whose flags were given (to pass on as keyword options: the rest keep defaults)."""
    return {
        f.name: getattr(args, f.name)
        for f in cli_fields(cls, names, exclude)
        if getattr(args, f.name, None) is not None
    }


def to_argv(
    cls: type, values: Mapping[str, Any] | Any, names: Iterable[str] | None = None, exclude: Iterable[str] = ()
) -> list[str]:
    """The flags that give `values` (a config of `cls`, or a mapping of its field names) to a command whose
    parser `add_options(..., cls)` built: only the fields that differ from `cls`'s defaults."""
    if isinstance(values, Mapping):
        fields: Mapping[str, Any] = values
    else:
        fields = {f.name: getattr(values, f.name) for f in dataclasses.fields(values)}
    argv: list[str] = []
    for f in cli_fields(cls, names, exclude):
        value = fields.get(f.name)
        if value is None or value == f.default:
            continue
        flag = flag_of(f)
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif f.metadata.get("show"):  # several values after one flag (a mapping: its items)
            elements = list(value.items()) if isinstance(value, Mapping) else list(value)
            argv += [flag, *(f.metadata["show"](element) for element in elements)] if elements else []
        elif f.metadata.get("parse"):  # a value given as it is given in Python (a dict): its parsed form's text
            argv += [flag, value if isinstance(value, str) else str(f.metadata["parse"](value))]
        else:
            argv += [flag, str(value)]
    return argv
