"""Writes docs/configuration.md from the code itself: every settings model's env vars, every command's flags,
and every other environment variable the Python code reads, so the page cannot go stale (a test compares)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import re
import sys
import types
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings

from . import cli, registry
from .kubectl_plugin import cli as kubectl_cli

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
"""The checkout: `shared/` and `services/` sit side by side in it."""

REGENERATE = "make docs"

HEADER = """\
# Configuration

*For operators and anyone deploying or running a service: every environment variable and flag, with its
default. Generated from the settings models and the command-line parsers by `{regenerate}`
(`python -m kai_isolator.services.config_docs docs/configuration.md`); `make test` fails while this page
differs from what the code generates, so edit the code, not this page.*

Every setting is an environment variable; a command-line flag of the same name wins over the environment
(`shared/settings.py`, `load`). A value that does not parse, or breaks a bound, stops the command with an
error naming the variable. Lists in the environment are JSON (`'["a", "b"]'`); booleans are `true` /
`false` (or `1` / `0`). Durations given as flags take units where the flag says so (`10m`, `500ms`); the
environment variables ending in `_S` are seconds.

Each service's own settings live next to it (`services/<name>/settings.py`); the NATS, probe and log
settings are shared (`shared/settings.py`). The library's own environment contract (`CUDA_DEVICE_MEMORY_LIMIT`,
`VGPU_GRANT_WAIT_SECONDS`, ...) is in [hami-core/README.md](../hami-core/README.md); the Helm values that set
these are in [deploy/README.md](../deploy/README.md).
"""

OTHER_ENV: dict[str, str] = {
    "CUDA_HOME": "where `make images` finds `cuda.h` for the node agent image's library build (default `.cuda-headers/nvidia/cu13`)",
    "DOCKER_HOST": "the Docker engine `make images` and the compose tests use; unset, the system's, else `hack/dockerd`'s private one",
    "GOFLAGS": "kept for the builds of the control plane and the real node, which add `-p=2 -trimpath -buildvcs=false -mod=readonly`",
    "KAI_ISOLATOR_DOCKER_STATE": "where `hack/dockerd` keeps its engine (default `~/.cache/kai-isolator/docker`)",
    "KAI_ISOLATOR_KAI_SOURCE": "the KAI-Scheduler source archive `make kai` builds from (default: the one in "
                               "`../shared/third_party/kai-scheduler/` beside the checkout)",
    "KAI_ISOLATOR_KUBE_CACHE": "where the built etcd, kube-apiserver, kubectl, promtool and real-node binaries are cached "
                               "(default `~/.cache/kai-isolator/kube`)",
    "KUBECONFIG": "the kubeconfig the watcher (without `--kubeconfig`, outside a cluster) and `kubectl isolator` read",
    "KUBERNETES_SERVICE_HOST": "set by Kubernetes in every pod: with `KUBERNETES_SERVICE_PORT`, the in-cluster API server",
    "KUBERNETES_SERVICE_PORT": "set by Kubernetes in every pod: the in-cluster API server's port",
    "NODE_NAME": "the node agent's node name when neither `--node-name` nor `KAI_ISOLATOR_NODE_NAME` is set (the downward API)",
    "NO_COLOR": "set to anything: `kubectl isolator` prints no colour",
    "PATH": "passed on to the processes the node agent (self-check), the demo kubelet and the real node start",
    "PIP_CERT": "a CA bundle `make images` copies into the build stages (or `SSL_CERT_FILE`)",
    "SSL_CERT_FILE": "a CA bundle `make images` copies into the build stages when `PIP_CERT` is unset",
    "TERM": "`dumb`: `kubectl isolator` prints no colour",
    "XDG_CACHE_HOME": "the cache root of the build caches above (default `~/.cache`)",
}
"""What each environment variable read outside the settings models means. The generator fails on one it
finds read in the code and not described here, and on one described here that the code no longer reads."""

_ENV_READS = (
    re.compile(r"""\b(?:environ|env)\.get\(\s*["']([A-Z][A-Z0-9_]*)["']"""),
    re.compile(r"""\bgetenv\(\s*["']([A-Z][A-Z0-9_]*)["']"""),
    re.compile(r"""\b(?:environ|env)\[\s*["']([A-Z][A-Z0-9_]*)["']\s*\](?!\s*=[^=])"""),
    re.compile(r"""["']([A-Z][A-Z0-9_]*)["']\s+(?:not\s+)?in\s+(?:os\.)?(?:environ|env)\b"""),
    # A name of ours spelt whole as a constant is read through it (`KAI_SOURCE_ENV = "KAI_ISOLATOR_KAI_SOURCE"`).
    re.compile(r"""["'](KAI_ISOLATOR_[A-Z0-9_]*[A-Z0-9])["']"""),
)


class ConfigDocsError(Exception):
    """The code and OTHER_ENV disagree: the page would be incomplete or describe something gone."""


def settings_classes() -> list[type[BaseSettings]]:
    """Every settings model with fields: the shared ones, then each service's, in the CLI's order."""
    modules = [importlib.import_module("kai_isolator.shared.settings")]
    for service in registry.SERVICES:
        with contextlib.suppress(ModuleNotFoundError):
            modules.append(importlib.import_module(f"kai_isolator.services.{service}.settings"))
    return [obj for m in modules for obj in vars(m).values()
            if isinstance(obj, type) and issubclass(obj, BaseSettings) and obj.__module__ == m.__name__ and obj.model_fields]


def commands() -> list[tuple[argparse.ArgumentParser, Any]]:
    """Each `kai-isolator` subcommand's parser, as the CLI builds it, with the module that defines it."""
    top = argparse.ArgumentParser(prog="kai-isolator")
    subparsers = top.add_subparsers(dest="command")
    found = []
    for module in cli.command_modules():
        parser = module.add_parser(subparsers)
        cli.add_common_flags(parser)
        cli.add_bus_flags(parser)
        found.append((parser, module))
    return found


def loaded_by(modules: Iterable[Any]) -> set[str]:
    """Names of the settings classes a module builds with `load(...)`."""
    return {name for module in modules for name in re.findall(r"\bload\(\s*(\w+)\s*,", inspect.getsource(module))}


def settings_users(found: list[tuple[argparse.ArgumentParser, Any]]) -> dict[str, list[argparse.ArgumentParser]]:
    """Settings class name -> the command parsers whose commands load it (cli.py's loads apply to all)."""
    everyone = loaded_by([cli])
    users: dict[str, list[argparse.ArgumentParser]] = {}
    for parser, module in found:
        for name in loaded_by([module]) | everyone:
            users.setdefault(name, []).append(parser)
    return users


def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's flags, without --help."""
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def subcommands(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    return [sub for a in parser._actions if isinstance(a, argparse._SubParsersAction) for sub in a.choices.values()]


def env_name(cls: type[BaseSettings], field: str) -> str:
    return (str(cls.model_config.get("env_prefix", "")) + field).upper()


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def code(text: str) -> str:
    return f"`{text}`" if text else ""


def type_text(annotation: Any) -> str:
    """A reader's name for a field's type."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        kept = [a for a in args if a is not type(None)]
        return " or ".join(type_text(a) for a in kept)
    if origin is typing.Literal:
        return "one of " + ", ".join(code(str(a)) for a in args)
    if origin in (list, tuple):
        return f"list of {type_text(args[0])}" if args else "list"
    names = {bool: "true/false", int: "integer", float: "number", str: "text", Path: "path"}
    return names.get(annotation, getattr(annotation, "__name__", str(annotation)))


def bounds(field: FieldInfo) -> str:
    """The field's limits (gt, ge, lt, le, length, pattern) as a short phrase."""
    parts = []
    for meta in field.metadata:
        for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"), ("min_length", "length ≥"), ("max_length", "length ≤")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sign} {number(value)}")
        pattern = getattr(meta, "pattern", None)
        if pattern:
            parts.append(f"matches `{pattern}`")
    return ", ".join(parts)


def number(value: Any) -> str:
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


def default_text(field: FieldInfo) -> str:
    value = field.get_default(call_default_factory=True)
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return code(str(value).lower())
    if isinstance(value, (int, float)):
        return code(number(value))
    if isinstance(value, (list, tuple)):
        return code(json.dumps([str(v) for v in value]))
    return code(str(value))


def flag_text(action: argparse.Action) -> str:
    spelled = " / ".join(action.option_strings)
    if action.nargs == 0:
        return code(spelled)
    longest = max(action.option_strings, key=len).lstrip("-").replace("-", "_").upper()
    value = action.metavar or ("|".join(map(str, action.choices)) if action.choices else longest)
    return code(f"{spelled} {value}")


def setting_flags(cls: type[BaseSettings], field: str, users: dict[str, list[argparse.ArgumentParser]]) -> list[tuple[str, argparse.Action]]:
    """(command, action) for each flag that sets this field in a command that loads this class."""
    found = []
    for parser in users.get(cls.__name__, []):
        found += [(parser.prog, a) for a in options(parser) if a.dest == field]
    return found


def settings_section(cls: type[BaseSettings], users: dict[str, list[argparse.ArgumentParser]]) -> list[str]:
    source = inspect.getsourcefile(cls) or ""
    where = Path(source).resolve().relative_to(PACKAGE_ROOT).as_posix() if source else cls.__module__
    commands_using = sorted({p.prog for p in users.get(cls.__name__, [])})
    used = ", ".join(code(c) for c in commands_using) if len(commands_using) < 8 else "every command"
    lines = [f"### {cls.__name__}", ""]
    if cls.__doc__:
        lines += [cell(inspect.cleandoc(cls.__doc__)), ""]
    lines += [f"`{where}`; read by {used or 'no command directly'}.", "",
              "| variable | flag | type | default | meaning |", "|---|---|---|---|---|"]
    for name, field in cls.model_fields.items():
        flags = setting_flags(cls, name, users)
        spelled = sorted({" / ".join(a.option_strings) for _, a in flags})
        meaning = field.description or next((a.help for _, a in flags if a.help), "") or ""
        limits = bounds(field)
        kind = type_text(field.annotation) + (f" ({limits})" if limits else "")
        lines.append(f"| `{env_name(cls, name)}` | {', '.join(code(s) for s in spelled) or 'env only'} | {cell(kind)} | "
                     f"{cell(default_text(field))} | {cell(meaning)} |")
    return [*lines, ""]


def backing_env(action: argparse.Action, parser: argparse.ArgumentParser, users: dict[str, list[argparse.ArgumentParser]],
                classes: list[type[BaseSettings]]) -> str:
    for cls in classes:
        if parser in users.get(cls.__name__, []) and action.dest in cls.model_fields:
            return code(env_name(cls, action.dest))
    return ""


def flags_section(parser: argparse.ArgumentParser, users: dict[str, list[argparse.ArgumentParser]],
                  classes: list[type[BaseSettings]]) -> list[str]:
    lines = [f"### `{parser.prog}`", ""]
    if parser.description:
        lines += [cell(parser.description.strip().splitlines()[0]), ""]
    lines += ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for action in options(parser):
        default = "" if action.default in (None, argparse.SUPPRESS, False) else code(number(action.default))
        lines.append(f"| {cell(flag_text(action))} | {backing_env(action, parser, users, classes)} | {default} | {cell(action.help or '')} |")
    lines.append("")
    for sub in subcommands(parser):
        lines += flags_section(sub, users, classes)
    return lines


def env_reads(roots: Sequence[Path], base: Path = PACKAGE_ROOT) -> dict[str, list[str]]:
    """Environment variable -> the modules (relative to `base`) that read it directly, not through a settings model."""
    found: dict[str, set[str]] = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            if path.resolve() == Path(__file__).resolve():  # OTHER_ENV's own keys are not reads
                continue
            text = path.read_text()
            for pattern in _ENV_READS:
                for name in pattern.findall(text):
                    found.setdefault(name, set()).add(path.relative_to(base).as_posix())
    return {name: sorted(paths) for name, paths in sorted(found.items())}


def other_env_section(roots: Sequence[Path], base: Path = PACKAGE_ROOT) -> list[str]:
    """The table of OTHER_ENV, checked against what the code under `roots` reads."""
    settings = {env_name(cls, field) for cls in settings_classes() for field in cls.model_fields}
    reads = {name: paths for name, paths in env_reads(roots, base).items() if name not in settings}
    undescribed = sorted(set(reads) - set(OTHER_ENV))
    gone = sorted(set(OTHER_ENV) - set(reads))
    if undescribed or gone:
        raise ConfigDocsError("services/config_docs.py OTHER_ENV is out of step with the code: "
                              + "; ".join(filter(None, [
                                  f"read but not described: {', '.join(undescribed)}" if undescribed else "",
                                  f"described but no longer read: {', '.join(gone)}" if gone else ""])))
    lines = ["## Other environment variables", "",
             "Read directly by the code, not through a settings model (found in `shared/` and `services/`).", "",
             "| variable | read by | meaning |", "|---|---|---|"]
    for name, paths in reads.items():
        lines.append(f"| `{name}` | {', '.join(code(p) for p in paths)} | {cell(OTHER_ENV[name])} |")
    return [*lines, ""]


def prefixes(classes: list[type[BaseSettings]]) -> list[str]:
    """One line saying which prefix each settings model reads its variables under."""
    by_prefix: dict[str, list[str]] = {}
    for cls in classes:
        by_prefix.setdefault(str(cls.model_config.get("env_prefix", "")), []).append(cls.__name__)
    spelled = "; ".join(f"`{prefix}<FIELD>` for {', '.join(names)}" for prefix, names in by_prefix.items())
    return [f"Variable names are the field's name in capitals under its model's prefix: {spelled} (e.g. "
            "`KAI_ISOLATOR_VERIFIER_REVERIFY_S=300`). `kai-isolator <command> --help` lists the flags.", ""]


def variable_names() -> set[str]:
    """Every environment variable the page documents."""
    return {env_name(cls, field) for cls in settings_classes() for field in cls.model_fields} | set(OTHER_ENV)


def render() -> str:
    """The whole page."""
    classes = settings_classes()
    found = commands()
    users = settings_users(found)
    lines = [HEADER.format(regenerate=REGENERATE), *prefixes(classes), "## Environment variables, by settings model", ""]
    for cls in classes:
        lines += settings_section(cls, users)
    lines += ["## Flags, by command", "",
              "Flags without a variable have no environment equivalent. `--log-level`, `--log-json` and "
              "`--nats-url` are on every command.", ""]
    for parser, _ in found:
        lines += flags_section(parser, users, classes)
    lines += flags_section(kubectl_cli.parser(), {}, [])
    lines += other_env_section([PACKAGE_ROOT / "shared", PACKAGE_ROOT / "services"])
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: Sequence[str] | None = None, out: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(prog="python -m kai_isolator.services.config_docs", description=__doc__)
    parser.add_argument("page", type=Path, help="the page to write (docs/configuration.md)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the page differs from the code")
    args = parser.parse_args(argv)
    try:
        page = render()
    except ConfigDocsError as error:
        out(str(error))
        return 2
    current = args.page.read_text() if args.page.exists() else None
    if args.check:
        if current != page:
            out(f"out of date: {args.page}; regenerate it with `{REGENERATE}`")
            return 1
        return 0
    if current != page:
        args.page.write_text(page)
        out(f"wrote {args.page}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
