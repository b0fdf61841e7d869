#!/usr/bin/env python3
"""``make demo``: train a small K3 model, serve it with ``k3 up``, chat with it through the router.

What it does, in order:

1. **Model.** Uses the checkpoint in ``runs/demo`` if there is one; otherwise pretrains the ``small`` preset
   with ``k3 train`` (progress bar on the terminal). The run is budgeted to a few minutes on two CPU cores
   (``--steps`` sized for that, ``--max-minutes`` as a hard cap), so it produces a model that writes
   text-like bytes, not a capable assistant: the demo is about the platform.
2. **Platform.** Starts ``k3 up --checkpoint runs/demo`` (cache store, prefill, decode and router as four
   processes; their logs go to ``runs/demo/up.log``) and waits for the router.
3. **Conversation.** Two turns through the router's Chat API with a declared ``get_weather`` tool: the
   user asks, the assistant calls the tool, the tool answers, the assistant replies. A few minutes of
   pretraining do not teach a model to call tools, so if the model did not emit the call itself the demo
   writes that assistant step into the history (and says so); the result is rendered as XTML and sent
   through the same path either way. Every answer streams as it is generated.
4. **Cache.** After each turn: prompt tokens, how many were restored from the prefix cache, the cost at the
   launch prices and what the cache saved. The second turn repeats the first turn's long system prompt
   and messages, so most of its prompt is a cache hit.
5. **Stop.** Sends Ctrl-C (SIGINT) to ``k3 up``, which stops all four services.

Run it from the repository root with the project's virtual environment (``make demo`` does both).
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "runs" / "demo"
# One step of the small preset on 1024 tokens takes roughly 15-20 s on two CPU cores, so 16 steps fit the
# few minutes the demo gives training; --max-minutes stops it (with a checkpoint) on a slower machine.
TRAIN_STEPS = 16
TRAIN_MAX_MINUTES = 4
TRAIN_ARGS = ["--preset", "small", "--steps", str(TRAIN_STEPS), "--max-minutes", str(TRAIN_MAX_MINUTES),
              "--batch-tokens", "1024", "--eval-every", "0", "--save-every", "0", "--corpus-bytes", "2000000"]

SYSTEM = (
    "You are the assistant of the k3 serving platform demo. k3 trains and serves language models of the "
    "Kimi K3 architecture: Kimi Delta Attention layers keep a fixed-size memory per sequence, gated MLA layers "
    "keep a compressed latent cache, and Stable LatentMoE layers route every token to a few experts. The "
    "platform runs as separate gRPC services: a router that renders conversations as XTML, tokenises them, "
    "admits requests and routes them by cached prefix; prefill workers that restore the longest cached "
    "prefix and compute only the rest; decode workers that batch sequences continuously and stream tokens; "
    "and a cache store that keeps KDA state checkpoints and MLA latent blocks addressed by chained hashes of "
    "512-token blocks. When a conversation continues, its earlier turns are already in the cache store, so "
    "only the new message has to be computed, and cache-hit input tokens cost a tenth of the others. "
    "Answer briefly and use the tools you are given when they help."
)
TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]


def say(text: str = "") -> None:
    print(text, flush=True)


def heading(text: str) -> None:
    say()
    say(f"== {text} " + "=" * max(0, 72 - len(text)))


def k3(*args: str) -> list[str]:
    return [sys.executable, "-m", "k3", *args]


def ensure_model() -> None:
    from k3.model.checkpoint import CheckpointError, latest_checkpoint

    try:
        found = latest_checkpoint(RUN) if RUN.is_dir() else None
    except CheckpointError:
        found = None
    if found is not None:
        say(f"using the trained model in {found.relative_to(ROOT)} (delete runs/demo to train a new one)")
        return
    if RUN.exists():
        say(f"{RUN.relative_to(ROOT)} holds no complete checkpoint: starting its training over")
        shutil.rmtree(RUN)
    say(f"training the small preset for up to {TRAIN_STEPS} steps (at most {TRAIN_MAX_MINUTES} minutes)...")
    status = subprocess.run(k3("train", "--out", str(RUN), *TRAIN_ARGS), cwd=ROOT).returncode
    if status != 0 or latest_checkpoint(RUN) is None:
        raise SystemExit(f"k3 train exited with status {status}; run make demo again to resume the demo")


class Platform:
    """``k3 up`` as a child process; its log goes to ``runs/demo/up.log``."""

    def __init__(self) -> None:
        self.log_path = RUN / "up.log"
        self._log = open(self.log_path, "w", encoding="utf-8")  # closed in stop()
        self.proc = subprocess.Popen(
            k3("up", "--checkpoint", str(RUN), "--port", "0"), cwd=ROOT, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True,
        )
        self._lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._copy, daemon=True).start()

    def _copy(self) -> None:
        for line in self.proc.stdout:
            self._log.write(line)
            self._log.flush()
            self._lines.put(line)
        self._lines.put(None)

    def wait_ready(self, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self._lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise SystemExit(f"the platform did not start in {timeout:.0f}s; see {self.log_path}") from None
            if line is None:
                raise SystemExit(f"k3 up exited with status {self.proc.wait()}; see {self.log_path}")
            if line.startswith("k3 up: started") or " ready on " in line:
                say("  " + line.strip())
            match = re.match(r"k3 up: router listening on (\S+)", line)
            if match:
                return match.group(1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def printable(text: str) -> str:
    """Model text with control characters shown as U+00B7: a barely trained model writes arbitrary bytes,
    and escape sequences must not reach the terminal."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else "\u00b7" for c in text)


def weather(city: str) -> str:
    return json.dumps({"city": city, "temperature_c": 18, "sky": "light rain", "wind_kmh": 12})


def ask(stub, history, label: str):
    from k3.commands.chat import stream_chat
    from k3.protos.v1 import inference_pb2

    request = inference_pb2.ChatRequest(
        messages=history, tools_json=json.dumps(TOOLS), thinking=False,
        sampling=inference_pb2.SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, seed=7),
    )
    sys.stdout.write(f"assistant ({label}): ")
    result = stream_chat(stub, request, timeout=600, on_response=lambda text: sys.stdout.write(printable(text)) or
                         sys.stdout.flush())
    say()
    return result


def show_usage(label: str, usage) -> dict:
    saved = usage.cost_without_cache_usd - usage.cost_usd
    share = usage.cached_prompt_tokens / usage.prompt_tokens if usage.prompt_tokens else 0.0
    say(f"  [{label}] prompt {usage.prompt_tokens} tokens, {usage.cached_prompt_tokens} from the cache "
        f"({share:.0%}); {usage.completion_tokens} generated; cost ${usage.cost_usd:.6f} vs "
        f"${usage.cost_without_cache_usd:.6f} without the cache (saved ${saved:.6f})")
    return {"prompt": usage.prompt_tokens, "cached": usage.cached_prompt_tokens, "cost": usage.cost_usd,
            "without": usage.cost_without_cache_usd}


def converse(address: str) -> None:
    import grpc

    from k3.protos.v1 import inference_pb2, inference_pb2_grpc

    msg = inference_pb2.ChatMessage
    history = [msg(role="system", content=SYSTEM), msg(role="user", content="What is the weather in Paris?")]
    with grpc.insecure_channel(address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        say("user: What is the weather in Paris?")
        first = ask(stub, history, "turn 1")
        turn1 = show_usage("turn 1", first.usage)
        call = next((c for c in first.tool_calls if c["name"] == "get_weather"), None)
        if call is not None:
            say(f"  the model called get_weather({call['arguments']})")
            arguments = call["arguments"]
            content = first.content
        else:
            say("  (the demo model is too small to call tools by itself; the demo writes the assistant's "
                "tool call into the history)")
            arguments, content = json.dumps({"city": "Paris"}), "Let me check the weather."
        try:
            city = json.loads(arguments).get("city", "Paris")
        except (ValueError, AttributeError):
            city = "Paris"
        result = weather(city)
        say(f"tool get_weather -> {result}")
        history += [
            msg(role="assistant", content=content,
                tool_calls=[inference_pb2.ToolCall(id="call_1", name="get_weather", arguments_json=arguments)]),
            msg(role="tool", content=result, tool_call_id="call_1"),
        ]
        second = ask(stub, history, "turn 2")
        turn2 = show_usage("turn 2", second.usage)
    heading("prefix cache")
    say(f"turn 1 computed {turn1['prompt'] - turn1['cached']} of {turn1['prompt']} prompt tokens; turn 2 "
        f"restored {turn2['cached']} of its {turn2['prompt']} from the cache store and computed only "
        f"{turn2['prompt'] - turn2['cached']}.")
    saved = turn1["without"] + turn2["without"] - turn1["cost"] - turn2["cost"]
    say(f"cost of the conversation: ${turn1['cost'] + turn2['cost']:.6f} "
        f"(${turn1['without'] + turn2['without']:.6f} without the cache: saved ${saved:.6f}) at $0.30/M "
        "cache-hit input, $3.00/M cache-miss input, $15.00/M output tokens")


def main() -> int:
    os.chdir(ROOT)
    started = time.monotonic()
    heading("1. a trained small model")
    ensure_model()
    heading("2. the platform: k3 up (logs in runs/demo/up.log)")
    platform = Platform()
    try:
        address = platform.wait_ready()
        say(f"router listening on {address}")
        heading("3. a conversation with a tool call, through the router")
        converse(address)
    finally:
        heading("4. stopping the platform")
        platform.stop()
        say(f"k3 up exited with status {platform.proc.returncode}")
    say(f"demo finished in {time.monotonic() - started:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
