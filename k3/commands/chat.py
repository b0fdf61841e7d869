"""``k3 chat`` and ``k3 generate``: talk to a router from the terminal.

- ``k3 chat`` is a REPL (``/reset`` forgets the conversation, ``/usage`` prints the running totals,
  ``/quit`` or Ctrl-D leaves); ``k3 chat --message TEXT`` asks once and exits. Answers stream as they are
  generated: reasoning dimmed (when ``--thinking-effort`` turns thinking on), then the response, then the
  tool calls. With ``--tools FILE`` (a JSON list of OpenAI-style tool definitions) the model may call tools;
  the REPL asks you for each call's result and sends it back, one-shot mode prints the calls and exits.
- ``k3 generate --prompt TEXT`` continues raw text (no chat format) and streams it.
- ``--image PATH`` and ``--video PATH`` (repeatable) attach images and video files (MP4, WebM, GIF, ...) to
  the first user message (``--message`` or the REPL's first line), before its text, images first; in the
  REPL ``/image PATH`` and ``/video PATH`` attach one to the next message. Both travel as their file bytes
  (the router has them encoded by the vision service, which caches them by content, so resending one in
  later turns costs no encoder pass).

Usage (tokens, cached tokens and cost at the router's prices) goes to stderr after each answer, so stdout
holds only the model's text. ``stream_chat`` is the reusable part: one Chat call with callbacks per delta.
"""

from __future__ import annotations

import argparse
import json
import sys
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass, field

DIM, RESET = "\033[2m", "\033[0m"


def register(subparsers: argparse._SubParsersAction) -> None:
    chat = subparsers.add_parser("chat", help="chat with the served model through the router")
    _common(chat)
    chat.add_argument("--message", help="send this one message, print the answer and exit")
    chat.add_argument("--system", help="system message opening the conversation")
    chat.add_argument("--tools", metavar="FILE", help="JSON list of OpenAI-style tool definitions")
    chat.add_argument("--thinking-effort", choices=["low", "high", "max", "none"], default="none",
                      help="reasoning effort; none (default) answers without a think channel")
    chat.add_argument("--image", action="append", default=[], metavar="PATH",
                      help="attach an image file to the first message (repeatable)")
    chat.add_argument("--video", action="append", default=[], metavar="PATH",
                      help="attach a video file (MP4, WebM, GIF, ...) to the first message (repeatable)")
    chat.set_defaults(func=run_chat)

    generate = subparsers.add_parser("generate", help="continue a text prompt through the router")
    _common(generate)
    generate.add_argument("--prompt", required=True, help="text to continue")
    generate.add_argument("--top-p", type=float, default=0.0, help="nucleus mass (0 = off)")
    generate.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.set_defaults(func=run_generate)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", default="127.0.0.1:50051", metavar="HOST:PORT", help="router address")
    parser.add_argument("--max-tokens", type=int, default=256, help="tokens to generate at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--seed", type=int, help="sampling seed")
    parser.add_argument("--timeout", type=float, default=600.0, help="deadline of each request, seconds")


@dataclass
class ChatResult:
    """One assistant answer, assembled from the stream."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[dict] = field(default_factory=list)  # {"name", "arguments"} per call, in order
    finish_reason: str = ""
    usage: object = None


def stream_chat(stub, request, *, timeout: float, on_think: Callable[[str], None] = lambda s: None,
                on_response: Callable[[str], None] = lambda s: None) -> ChatResult:
    """Send one ``ChatRequest`` and assemble the answer; ``grpc.RpcError`` propagates."""
    result = ChatResult()
    calls: dict[int, dict] = {}
    for message in stub.Chat(request, timeout=timeout):
        if message.think_delta:
            result.reasoning += message.think_delta
            on_think(message.think_delta)
        if message.response_delta:
            result.content += message.response_delta
            on_response(message.response_delta)
        for delta in message.tool_calls:
            call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
            call["name"] = call["name"] or delta.name
            call["arguments"] += delta.arguments_delta
        if message.finish_reason:
            result.finish_reason = message.finish_reason
        if message.HasField("usage"):
            result.usage = message.usage
    result.tool_calls = [calls[i] for i in sorted(calls)]
    return result


def format_usage(usage) -> str:
    if usage is None:
        return "usage: not reported"
    saved = usage.cost_without_cache_usd - usage.cost_usd
    return (f"usage: {usage.prompt_tokens} prompt tokens ({usage.cached_prompt_tokens} from cache), "
            f"{usage.completion_tokens} generated; cost ${usage.cost_usd:.6f} "
            f"(${usage.cost_without_cache_usd:.6f} without the cache, saved ${saved:.6f})")


def _rpc_error(exc, router: str):
    from k3.cli import CLIError
    from k3.services.common.client import error_detail

    detail = error_detail(exc)
    where = f" [{detail.field}]" if detail is not None and detail.field else ""
    return CLIError(f"router {router}: {exc.code().name}{where}: {exc.details()}")


def _sampling(args: argparse.Namespace):
    from k3.protos.v1 import inference_pb2

    sampling = inference_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        sampling.seed = args.seed
    return sampling


def _load_tools(path: str | None) -> str:
    from k3.cli import CLIError

    if path is None:
        return ""
    try:
        with open(path, encoding="utf-8") as f:
            tools = json.load(f)
    except OSError as exc:
        raise CLIError(f"--tools: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise CLIError(f"--tools: {path} is not valid JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(tools, list):
        raise CLIError(f"--tools: {path} must hold a JSON list of tool definitions")
    return json.dumps(tools)


class _Printer:
    """Streams an answer to stdout: reasoning dimmed on a terminal, then the response.

    On a terminal, control characters in the model's text are shown as U+00B7 so that a model writing
    arbitrary bytes cannot send escape sequences to it; piped output stays exactly what the model wrote.
    """

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.thinking = False

    def _write(self, text: str) -> None:
        if self.tty:
            text = "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else "\u00b7" for c in text)
        sys.stdout.write(text)
        sys.stdout.flush()

    def think(self, text: str) -> None:
        if not self.thinking:
            self.thinking = True
            sys.stdout.write(DIM if self.tty else "[thinking] ")
        self._write(text)

    def response(self, text: str) -> None:
        self._end_think()
        self._write(text)

    def _end_think(self) -> None:
        if self.thinking:
            self.thinking = False
            sys.stdout.write(RESET + "\n" if self.tty else "\n[answer] ")

    def done(self) -> None:
        self._end_think()
        sys.stdout.write("\n")
        sys.stdout.flush()


def _read_media(path: str, kind: str):
    """An ``ImageRef`` holding the file at ``path``: image bytes, or a video container (``kind`` "video")."""
    from k3.cli import CLIError
    from k3.protos.v1 import inference_pb2, vision_pb2

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CLIError(f"--{kind}: cannot read {path}: {exc.strerror}") from None
    if kind == "video":
        return inference_pb2.ImageRef(video=vision_pb2.VideoFrames(container=data))
    return inference_pb2.ImageRef(data=data)


def _user_message(text: str, media: list):
    """A user message: plain content, or image/video parts followed by the text when media are attached."""
    from k3.protos.v1 import inference_pb2

    if not media:
        return inference_pb2.ChatMessage(role="user", content=text)
    parts = [inference_pb2.ContentPart(image=ref) for ref in media]
    parts.append(inference_pb2.ContentPart(text=text))
    return inference_pb2.ChatMessage(role="user", parts=parts)


def run_chat(args: argparse.Namespace) -> int:
    import grpc

    from k3.cli import CLIError
    from k3.protos.v1 import inference_pb2, inference_pb2_grpc

    tools_json = _load_tools(args.tools)
    pending_images = [_read_media(path, "image") for path in args.image]
    pending_images += [_read_media(path, "video") for path in args.video]
    declared = {t["function"].get("name") for t in json.loads(tools_json or "[]")
                if isinstance(t, dict) and isinstance(t.get("function"), dict)}
    history: list = []
    if args.system:
        history.append(inference_pb2.ChatMessage(role="system", content=args.system))
    channel = grpc.insecure_channel(args.router)
    stub = inference_pb2_grpc.InferenceStub(channel)
    totals = {"prompt": 0, "cached": 0, "generated": 0, "cost": 0.0, "without": 0.0}
    calls_made = 0

    def ask() -> ChatResult:
        nonlocal calls_made
        request = inference_pb2.ChatRequest(
            messages=history, tools_json=tools_json, thinking=args.thinking_effort != "none",
            thinking_effort=args.thinking_effort, sampling=_sampling(args),
        )
        printer = _Printer()
        try:
            result = stream_chat(stub, request, timeout=args.timeout, on_think=printer.think,
                                 on_response=printer.response)
        except grpc.RpcError as exc:
            raise _rpc_error(exc, args.router) from None
        printer.done()
        calls = []
        for call in result.tool_calls:
            print(f"-> tool call {call['name']}({call['arguments']})")
            if call["name"] not in declared:
                # An undeclared tool cannot be answered, and the router would refuse it in the history.
                print("   (not a declared tool: ignored)", file=sys.stderr)
                continue
            calls_made += 1
            calls.append(inference_pb2.ToolCall(id=f"call_{calls_made}", name=call["name"],
                                                arguments_json=call["arguments"]))
        history.append(inference_pb2.ChatMessage(role="assistant", content=result.content,
                                                 reasoning_content=result.reasoning, tool_calls=calls))
        if result.usage is not None:
            u = result.usage
            for key, value in (("prompt", u.prompt_tokens), ("cached", u.cached_prompt_tokens),
                               ("generated", u.completion_tokens), ("cost", u.cost_usd),
                               ("without", u.cost_without_cache_usd)):
                totals[key] += value
        print(format_usage(result.usage), file=sys.stderr)
        return result

    try:
        if args.message is not None:
            history.append(_user_message(args.message, pending_images))
            ask()
            return 0
        print(f"k3 chat with {args.router} — /image PATH, /video PATH, /reset, /usage, /quit", file=sys.stderr)
        while True:
            try:
                line = input("you> ")
            except EOFError:
                print(file=sys.stderr)
                return 0
            command = line.strip()
            if command in ("/quit", "/exit"):
                return 0
            if command == "/reset":
                history[:] = history[:1] if args.system else []
                continue
            if command == "/usage":
                print(f"totals: {totals['prompt']} prompt tokens ({totals['cached']} cached), "
                      f"{totals['generated']} generated, cost ${totals['cost']:.6f}, saved "
                      f"${totals['without'] - totals['cost']:.6f}", file=sys.stderr)
                continue
            if command.startswith(("/image ", "/video ")):
                kind, _, path = command[1:].partition(" ")
                try:
                    pending_images.append(_read_media(path.strip(), kind))
                except CLIError as exc:
                    print(f"k3: error: {exc}", file=sys.stderr)
                continue
            if not command:
                continue
            mark = len(history)
            history.append(_user_message(line, pending_images))
            pending_images = []
            try:
                ask()
                while history[-1].tool_calls:  # answer every call, then let the model continue
                    for message in list(history[-1].tool_calls):
                        output = input(f"result of {message.name}({message.arguments_json})> ")
                        history.append(inference_pb2.ChatMessage(role="tool", content=output,
                                                                 tool_call_id=message.id))
                    ask()
            except CLIError as exc:
                del history[mark:]  # the failed turn is not part of the conversation
                print(f"k3: error: {exc}", file=sys.stderr)
    finally:
        channel.close()


def run_generate(args: argparse.Namespace) -> int:
    import grpc

    from k3.protos.v1 import inference_pb2, inference_pb2_grpc

    sampling = _sampling(args)
    sampling.top_p = args.top_p
    sampling.top_k = args.top_k
    sampling.stop.extend(args.stop)
    usage = None
    with grpc.insecure_channel(args.router) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        try:
            for response in stub.Generate(inference_pb2.GenerateRequest(prompt=args.prompt, sampling=sampling),
                                          timeout=args.timeout):
                sys.stdout.write(response.text)
                sys.stdout.flush()
                if response.HasField("usage"):
                    usage = response.usage
        except grpc.RpcError as exc:
            raise _rpc_error(exc, args.router) from None
    sys.stdout.write("\n")
    print(format_usage(usage), file=sys.stderr)
    return 0
