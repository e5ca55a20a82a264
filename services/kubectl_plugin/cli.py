"""`kubectl-isolator` (so `kubectl isolator ...`): status, describe and nodes, from the Kubernetes API alone.

Exit status: 0 fine, 1 an error (kubeconfig, API unreachable, forbidden, not found), 2 bad usage,
3 when a container shown is `missing` or `breached` (status, describe) or a node's agent is stale,
not ready or failing its self-check (nodes), so scripts and CI can gate on it.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import datetime, timezone
from pathlib import Path

from kai_isolator.shared.errors import IsolatorError

from . import views
from .api import ApiError, Kube, Obj
from .output import age, dump, mib, table

EXIT_ERROR, EXIT_PROBLEM = 1, 3


def _common(parser: argparse.ArgumentParser, *, top: bool) -> None:
    # On the subcommands the defaults are suppressed, so a flag given before the subcommand is not reset after it.
    default = None if top else argparse.SUPPRESS
    parser.add_argument("--kubeconfig", type=Path, default=default, help="path to the kubeconfig file (default $KUBECONFIG or ~/.kube/config)")
    parser.add_argument("--context", default=default, help="the kubeconfig context to use")
    parser.add_argument("-n", "--namespace", default=default, help="the namespace (default: the context's, else default)")
    parser.add_argument("-o", "--output", choices=["wide", "json", "yaml"], default=default, help="output format")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="kubectl isolator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _common(top, top=True)
    top.add_argument("-A", "--all-namespaces", action="store_true", default=False, help="every namespace")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND")
    status = commands.add_parser("status", help="one row per GPU-sharing container: grant, used, verdict; problems first")
    describe = commands.add_parser("describe", help="one pod's isolation story in order, from its Events, annotations and conditions")
    describe.add_argument("pod", metavar="POD")
    nodes = commands.add_parser("nodes", help="per GPU node: library versions, self-check, agent last seen, grants vs the card")
    for sub in (status, describe, nodes):
        _common(sub, top=False)
    status.add_argument("-A", "--all-namespaces", action="store_true", default=argparse.SUPPRESS, help="every namespace")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return asyncio.run(_run(args))
    except IsolatorError as error:
        text = str(error)
        print(text if text.startswith("Error from server") else f"error: {text}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130


async def _run(args: argparse.Namespace) -> int:
    async with await Kube.connect(args.kubeconfig, args.context) as kube:
        namespace = None if args.all_namespaces and args.command != "describe" else (args.namespace or kube.namespace)
        if args.command == "status":
            return await status(kube, namespace, args.output)
        if args.command == "describe":
            return await describe(kube, namespace or kube.namespace, args.pod, args.output)
        return await nodes(kube, args.output)
    return EXIT_ERROR


async def _optional(kube: Kube, what: str, warnings: list[str], plural: str, namespace: str | None = None) -> list[Obj]:
    """A list the view is better with but can do without (a namespaced user may not read Nodes): a warning, not an error."""
    try:
        return await kube.list(plural, namespace)
    except ApiError as error:
        if error.status is None:
            raise
        warnings.append(f"{what} not shown: {error}")
        return []


async def _configmaps(kube: Kube, namespaces: set[str], warnings: list[str]) -> dict[tuple[str, str], Obj]:
    found: dict[tuple[str, str], Obj] = {}
    for ns in sorted(namespaces):
        for cm in await _optional(kube, f"limits from ConfigMaps in {ns}", warnings, "configmaps", ns):
            found[(ns, cm["metadata"]["name"])] = cm
    return found


async def gather(kube: Kube, namespace: str | None) -> views.StatusList:
    pods = [p for p in await kube.list("pods", namespace) if views.tracked(p)]
    warnings: list[str] = []
    if not pods:
        return views.StatusList(items=[])
    events = await _optional(kube, "verdicts from Events", warnings, "events", namespace)
    nodes_seen = await _optional(kube, "grant and usage (the node views)", warnings, "nodes")
    usage = views.usage_by_container(nodes_seen)
    missing_usage = {p["metadata"]["namespace"] for p in pods if (p["metadata"].get("uid"), views.target_container(p)) not in usage}
    configmaps = await _configmaps(kube, missing_usage, warnings)
    rows = views.sort_rows([views.container_row(p, events, usage, configmaps) for p in pods])
    return views.StatusList(items=rows, warnings=warnings)


def _warn(warnings: list[str]) -> None:
    for warning in warnings:
        print(f"Warning: {warning}", file=sys.stderr)


async def status(kube: Kube, namespace: str | None, output: str | None) -> int:
    listing = await gather(kube, namespace)
    _warn(listing.warnings)
    if output in ("json", "yaml"):
        dump(views.to_jsonable(listing), output)
    elif not listing.items:
        print(f"No GPU-sharing pods found in {namespace + ' namespace' if namespace else 'any namespace'}.", file=sys.stderr)
    else:
        now = datetime.now(timezone.utc)
        headers = ["NAMESPACE", "POD", "CONTAINER", "NODE", "GRANT", "USED", "VERDICT", "REASON", "AGE"]
        rows = [[r.namespace, r.pod, r.container, r.node or "<none>", mib(r.grant_bytes), mib(r.used_bytes), r.verdict, r.reason or "-",
                 age(r.verdict_at, now)] for r in listing.items]
        if output == "wide":
            headers += ["GRANT-FROM", "USAGE-FROM", "VERDICT-FROM", "REQUESTED", "MESSAGE"]
            for row, r in zip(rows, listing.items):
                row += [r.grant_from or "-", r.usage_source or "-", r.verdict_from or "-", r.requested or "-", r.message or "-"]
        if namespace is not None:
            headers, rows = headers[1:], [row[1:] for row in rows]
        table(headers, rows, sys.stdout, colour_column=headers.index("VERDICT"))
    return EXIT_PROBLEM if views.has_problem(listing.items) else 0


async def describe(kube: Kube, namespace: str, name: str, output: str | None) -> int:
    pod = await kube.pod(namespace, name)
    warnings: list[str] = []
    events = await _optional(kube, "Events", warnings, "events", namespace)
    nodes_seen = await _optional(kube, "grant and usage (the node views)", warnings, "nodes")
    configmaps = await _configmaps(kube, {namespace}, warnings)
    told = views.story(pod, events, views.usage_by_container(nodes_seen), configmaps)
    told.warnings = warnings
    _warn(warnings)
    if output in ("json", "yaml"):
        dump(views.to_jsonable(told), output)
    else:
        row = told.containers[0]
        out = sys.stdout
        out.write(f"Name:        {told.pod}\nNamespace:   {told.namespace}\nNode:        {told.node or '<none>'}\n")
        out.write(f"Container:   {row.container}\nVerdict:     {row.verdict}" + (f" ({row.reason})" if row.reason else "") + "\n")
        out.write(f"Grant:       {mib(row.grant_bytes)}" + (f" (from {row.grant_from})" if row.grant_from else "") + "\n")
        out.write(f"Used:        {mib(row.used_bytes)}" + (f" (from {row.usage_source})" if row.usage_source else "") + "\n")
        out.write("Annotations (tenant-writable):\n")
        for key, value in sorted(told.annotations.items()) or [("<none>", "")]:
            out.write(f"  {key}{': ' + value if value else ''}\n")
        out.write("Story:\n")
        table(["  TIME", "TYPE", "WHAT", "DETAIL"],
              [["  " + (e.time.strftime("%Y-%m-%dT%H:%M:%SZ") if e.time else "<unknown>"), e.kind, e.what, e.detail] for e in told.story], out)
    return EXIT_PROBLEM if views.has_problem(told.containers) else 0


async def nodes(kube: Kube, output: str | None) -> int:
    now = datetime.now(timezone.utc)
    rows = [views.node_row(n, now) for n in await kube.list("nodes") if views.is_gpu_node(n)]
    rows.sort(key=lambda r: (not views.node_problem(r), r.node))
    listing = views.NodeList(items=rows)
    if output in ("json", "yaml"):
        dump(views.to_jsonable(listing), output)
    elif not rows:
        print("No GPU nodes found.", file=sys.stderr)
    else:
        headers = ["NODE", "AGENT", "VERSION", "STAGED", "SELF-CHECK", "ENFORCER", "MODE", "LAST-SEEN", "CONTAINERS", "GRANTED", "CARD"]
        table_rows = []
        for r in rows:
            card = mib(r.card_bytes) + (" (over-committed)" if r.overcommitted else "")
            table_rows.append([r.node, r.agent, r.active_version or "<none>", ",".join(r.staged_versions) or "-", r.self_check or "<none>",
                               r.enforcer or "<none>", r.mode or "<none>", age(r.last_seen, now), str(r.containers), mib(r.granted_bytes), card])
        if output == "wide":
            headers.append("PROBLEMS")
            for table_row, r in zip(table_rows, rows):
                table_row.append("; ".join(r.problems) or "-")
        table(headers, table_rows, sys.stdout, colour_column=1)
    return EXIT_PROBLEM if any(views.node_problem(r) for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
