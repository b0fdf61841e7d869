"""``k3 jobs submit|watch|cancel|list``: training jobs on a trainer (``k3 serve trainer``).

- ``k3 jobs submit --kind pretrain|sft|rl [--preset P] [--checkpoint DIR|job:ID] [--name N] [--spec FILE]
  [--set KEY=VALUE ...] [--watch]`` prints the new job's id (and with ``--watch`` follows it). ``--spec`` is a
  YAML or JSON mapping of the kind's fields (``spec_json``; it may also hold ``kind``, ``name``, ``preset`` and
  ``checkpoint``); ``--set optimizer.lr=0.01`` sets one field by its dotted path, the value read as JSON when
  it parses (``20``, ``true``, ``[[1.0, 128]]``) and as a string otherwise. Flags win over the file.
- ``k3 jobs watch ID`` shows a live progress bar (step, loss, eval loss, state) with checkpoints and messages
  printed as they come; it replays the job's history first, so watching a finished job shows how it went.
  ``--json`` prints one JSON event per line instead. The exit status is 0 when the job SUCCEEDED, 1 otherwise.
- ``k3 jobs cancel ID`` asks the job to stop (it saves a checkpoint first); ``k3 jobs list [--json]``.

The trainer address is ``--trainer`` (default ``$K3_TRAINER`` or 127.0.0.1:50057); ``$K3_AUTH_TOKEN`` is sent
as the bearer token when set. Errors from the trainer are printed with the field they concern.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

DEFAULT_TRAINER = "127.0.0.1:50057"
SPEC_KEYS = ("kind", "name", "preset", "checkpoint")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("jobs", help="submit, watch, cancel and list training jobs (k3 serve trainer)")
    parser.add_argument("--trainer", default=os.environ.get("K3_TRAINER", DEFAULT_TRAINER), metavar="HOST:PORT",
                        help=f"trainer address (default $K3_TRAINER or {DEFAULT_TRAINER})")
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for each unary call")
    actions = parser.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)

    submit = actions.add_parser("submit", help="submit a pretrain, sft or rl job")
    submit.add_argument("--kind", choices=["pretrain", "sft", "rl"], help="job kind (or 'kind' in --spec)")
    submit.add_argument("--name", help="display name")
    submit.add_argument("--preset", help="model preset (pretrain, rl)")
    submit.add_argument("--checkpoint", help="starting checkpoint folder on the trainer, or job:ID (sft, rl)")
    submit.add_argument("--spec", metavar="FILE", help="YAML or JSON mapping of the job's fields")
    submit.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="set one field by its dotted path, e.g. optimizer.lr=0.01 (repeatable)")
    submit.add_argument("--watch", action="store_true", help="follow the job after submitting it")
    submit.set_defaults(func=run_submit)

    watch = actions.add_parser("watch", help="follow a job's progress (replays its history first)")
    watch.add_argument("id")
    watch.add_argument("--json", action="store_true", help="print events as JSON lines instead of a bar")
    watch.set_defaults(func=run_watch)

    cancel = actions.add_parser("cancel", help="stop a job (it saves a checkpoint first)")
    cancel.add_argument("id")
    cancel.set_defaults(func=run_cancel)

    listing = actions.add_parser("list", help="every job the trainer knows, oldest first")
    listing.add_argument("--json", action="store_true", help="print JSON instead of a table")
    listing.set_defaults(func=run_list)


# ---- spec building ---------------------------------------------------------------------------------------------
def build_spec(args: argparse.Namespace) -> dict[str, Any]:
    """``{kind, name, preset, checkpoint, spec_json}`` from ``--spec``, ``--set`` and the flags."""
    from k3.cli import CLIError

    body: dict[str, Any] = {}
    if args.spec:
        from k3.services.common.config import ConfigError, read_config_file

        try:
            body = read_config_file(args.spec)
        except ConfigError as exc:
            raise CLIError(f"--spec: {exc}") from None
    top = {key: body.pop(key) for key in SPEC_KEYS if key in body}
    for item in args.set:
        path, sep, text = item.partition("=")
        if not sep or not path.strip() or any(not part for part in path.strip().split(".")):
            raise CLIError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. optimizer.lr=0.01")
        _assign(body, path.strip().split("."), _parse_value(text), item)
    for key in SPEC_KEYS:
        value = getattr(args, key)
        if value is not None:
            top[key] = value
    for key, value in top.items():
        if not isinstance(value, str):
            raise CLIError(f"--spec: {key} must be a string, got {type(value).__name__}")
    if not top.get("kind"):
        raise CLIError("--kind is required (pretrain, sft or rl), or set 'kind' in --spec")
    return {**{key: top.get(key, "") for key in SPEC_KEYS}, "spec_json": json.dumps(body) if body else ""}


def _parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _assign(body: dict[str, Any], parts: list[str], value: Any, item: str) -> None:
    from k3.cli import CLIError

    node = body
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise CLIError(f"--set {item!r}: {part} is not a section (it holds {child!r})")
        node = child
    node[parts[-1]] = value


# ---- calls -----------------------------------------------------------------------------------------------------
def _stub(address: str):
    from k3.protos.v1 import jobs_pb2_grpc
    from k3.services.common.client import make_channel
    from k3.services.common.config import ServerConfig

    channel = make_channel(address, ServerConfig(auth_token=os.environ.get("K3_AUTH_TOKEN") or None))
    return channel, jobs_pb2_grpc.JobsStub(channel)


def _rpc_error(address: str, exc) -> Exception:
    from k3.cli import CLIError
    from k3.services.common.client import error_detail

    detail = error_detail(exc)
    where = f" ({detail.field})" if detail is not None and detail.field and detail.field not in exc.details() else ""
    return CLIError(f"trainer {address}: {exc.code().name}{where}: {exc.details()}")


def run_submit(args: argparse.Namespace) -> int:
    import grpc

    from k3.protos.v1 import jobs_pb2

    spec = build_spec(args)
    channel, stub = _stub(args.trainer)
    with channel:
        try:
            job = stub.Submit(jobs_pb2.JobSpec(**spec), timeout=args.timeout)
        except grpc.RpcError as exc:
            raise _rpc_error(args.trainer, exc) from None
    print(f"submitted {job.spec.kind} job {job.id} ({job.state})", flush=True)
    if args.watch:
        return _watch(args.trainer, job.id, as_json=False)
    return 0


def run_watch(args: argparse.Namespace) -> int:
    return _watch(args.trainer, args.id, as_json=args.json)


def run_cancel(args: argparse.Namespace) -> int:
    import grpc

    from k3.protos.v1 import jobs_pb2

    channel, stub = _stub(args.trainer)
    with channel:
        try:
            job = stub.Cancel(jobs_pb2.CancelRequest(id=args.id), timeout=args.timeout)
        except grpc.RpcError as exc:
            raise _rpc_error(args.trainer, exc) from None
    print(f"job {job.id}: {job.state} ({job.message})")
    return 0


def run_list(args: argparse.Namespace) -> int:
    import grpc

    from k3.protos.v1 import jobs_pb2

    channel, stub = _stub(args.trainer)
    with channel:
        try:
            jobs = stub.List(jobs_pb2.ListRequest(), timeout=args.timeout).jobs
        except grpc.RpcError as exc:
            raise _rpc_error(args.trainer, exc) from None
    rows = [{"id": j.id, "name": j.spec.name or j.spec.kind, "kind": j.spec.kind, "state": j.state,
             "step": j.step, "steps": j.steps, "message": j.message} for j in jobs]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print("no jobs")
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table("id", "name", "kind", "state", "step", "message")
    for row in rows:
        table.add_row(row["id"], row["name"], row["kind"], row["state"], f"{row['step']}/{row['steps'] or '?'}",
                      row["message"])
    Console().print(table)
    return 0


def _watch(address: str, job_id: str, *, as_json: bool) -> int:
    import grpc

    from k3.protos.v1 import jobs_pb2

    channel, stub = _stub(address)
    state = ""
    with channel:
        try:
            events = stub.Watch(jobs_pb2.WatchRequest(id=job_id))
            if as_json:
                for event in events:
                    state = event.state
                    print(json.dumps(_event_dict(event)), flush=True)
            else:
                state = _watch_bar(job_id, events)
        except grpc.RpcError as exc:
            raise _rpc_error(address, exc) from None
        except KeyboardInterrupt:
            events.cancel()
            print(f"stopped watching; the job goes on (k3 jobs watch {job_id}, k3 jobs cancel {job_id})")
            return 130
    return 0 if state == "SUCCEEDED" else 1


def _event_dict(event) -> dict[str, Any]:
    return {"id": event.id, "state": event.state, "step": event.step, "steps": event.steps,
            "metrics": dict(event.metrics), "checkpoint": event.checkpoint, "message": event.message}


def _watch_bar(job_id: str, events) -> str:
    """A rich bar over the job's steps; messages and checkpoints printed above it. Returns the last state."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = [TextColumn(f"[bold]{job_id}"), TextColumn("{task.fields[state]}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss [cyan]{task.fields[loss]}"), TextColumn("eval [red]{task.fields[eval]}"),
               TimeElapsedColumn()]
    state = ""
    with Progress(*columns) as progress:
        task = progress.add_task(job_id, total=None, state="-", loss="-", eval="-")
        for event in events:
            state = event.state
            fields: dict[str, Any] = {"state": event.state, "completed": event.step}
            if event.steps:
                fields["total"] = event.steps
            if "loss" in event.metrics:
                fields["loss"] = f"{event.metrics['loss']:.4f}"
            if "eval_loss" in event.metrics:
                fields["eval"] = f"{event.metrics['eval_loss']:.4f}"
            elif "eval_reward" in event.metrics:
                fields["eval"] = f"reward {event.metrics['eval_reward']:.3f}"
            progress.update(task, **fields)
            if event.message:
                progress.console.print(f"[dim]{event.state}[/dim] step {event.step}: {event.message}")
            if event.checkpoint:
                progress.console.print(f"checkpoint {event.checkpoint}")
    print(f"job {job_id}: {state}")
    return state
