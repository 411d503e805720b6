"""``verispec serve`` end to end: a real server process on loopback, driven by the ``openai`` client.

The fast tests serve the tiny random Llama (real tokenizer and chat template) with itself as the
draft model, so greedy drafts are always accepted and speculation is visibly at work. The slow tests
serve the real default model and check greedy answers against ``verispec generate --json``.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

API_KEY = "sk-verispec-test"
MAX_MODEL_LEN = 256
BODY_LIMIT = 64 * 1024
RSS_GROWTH_BOUND = 48 * 2**20
"""Allowed RSS growth of the server over 200 sequential requests, after 20 warm-up requests."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``python -m verispec.entrypoints.openai.api_server`` subprocess."""

    def __init__(self, args: list[str], startup_s: float = 120.0):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "verispec.entrypoints.openai.api_server",
            *args,
            "--port",
            str(self.port),
        ]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}: {self.proc.stderr.read()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.close()
        raise RuntimeError("server did not become healthy in time")

    def rss(self) -> int:
        """Resident memory of the server process in bytes."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return kib * 1024

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one sample in /metrics (0 when absent)."""
        text = httpx.get(f"{self.url}/metrics", timeout=5).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and labels in line:
                total += float(line.rsplit(" ", 1)[1])
        return total

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tiny_model_folder: Path) -> Iterator[Server]:
    folder = str(tiny_model_folder)
    with Server(
        [
            "--model",
            folder,
            "--speculative-model",
            folder,
            "--num-speculative-tokens",
            "3",
            "--served-model-name",
            "tiny",
            "--max-model-len",
            str(MAX_MODEL_LEN),
            "--api-key",
            API_KEY,
            "--max-num-seqs",
            "16",
            "--max-request-bytes",
            str(BODY_LIMIT),
        ]
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _chat(client: openai.OpenAI, content: str, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], **kw)


def _stream_chat(client: openai.OpenAI, content: str, **kw) -> tuple[str, list]:
    chunks = list(_chat(client, content, stream=True, **kw))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


# ----- happy paths -----


def test_models_lists_the_served_name(client: openai.OpenAI) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]


def test_chat_completion_reports_usage_and_acceptance(client: openai.OpenAI) -> None:
    resp = _chat(client, "Hello, who are you?", max_tokens=12, extra_body={"ignore_eos": True})
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 12
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    spec = resp.model_extra["speculative"]
    assert spec["num_speculative_tokens"] == 3
    # The draft is the target itself: greedy drafts are all accepted, so fewer target calls than tokens.
    assert spec["draft_tokens"] > 0 and spec["acceptance_rate"] > 0.9
    assert spec["target_calls"] < 12


def test_streaming_equals_non_streaming_and_ends_with_done(client: openai.OpenAI, server: Server) -> None:
    full = _chat(client, "Tell me a story.", max_tokens=20).choices[0].message.content
    text, chunks = _stream_chat(client, "Tell me a story.", max_tokens=20)
    assert text == full
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "speculative" in chunks[-1].model_extra
    raw = httpx.post(
        f"{server.url}/v1/chat/completions",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        timeout=30,
    ).text
    events = [line for line in raw.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert json.loads(events[-2][len("data: ") :])["usage"]["completion_tokens"] <= 4


def test_completions_streaming_and_not(client: openai.OpenAI) -> None:
    kw = dict(model="tiny", prompt="The capital of France is", max_tokens=10, temperature=0)
    full = client.completions.create(**kw)
    assert full.object == "text_completion" and full.usage.completion_tokens <= 10
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kw) if c.choices)
    assert streamed == full.choices[0].text
    by_ids = client.completions.create(**{**kw, "prompt": [1, 2, 3, 4]})
    assert by_ids.usage.prompt_tokens == 4


def test_per_request_speculation_control_is_lossless(client: openai.OpenAI) -> None:
    prompt = "Count from one to ten."
    on = _chat(client, prompt, max_tokens=16)
    off = _chat(client, prompt, max_tokens=16, extra_body={"speculative": {"enabled": False}})
    two = _chat(client, prompt, max_tokens=16, extra_body={"speculative": {"num_speculative_tokens": 2}})
    assert off.model_extra["speculative"]["draft_tokens"] == 0
    assert off.model_extra["speculative"]["target_calls"] == off.usage.completion_tokens
    assert len(two.model_extra["speculative"]["drafted_per_position"]) <= 2
    assert on.choices[0].message.content == off.choices[0].message.content == two.choices[0].message.content


def test_seed_reproduces_a_sampled_answer(client: openai.OpenAI) -> None:
    kw = dict(max_tokens=16, temperature=1.0, top_p=0.95, extra_body={"top_k": 50, "ignore_eos": True})
    a = _chat(client, "Say something random.", seed=11, **kw).choices[0].message.content
    b = _chat(client, "Say something random.", seed=11, **kw).choices[0].message.content
    c = _chat(client, "Say something random.", seed=12, **kw).choices[0].message.content
    assert a == b
    assert a != c  # 16 tokens from a near-uniform 49152-way distribution: a collision is not credible


def test_stop_string_cuts_the_text(client: openai.OpenAI) -> None:
    kw = dict(
        model="tiny",
        prompt="Once upon a time",
        max_tokens=24,
        temperature=1.0,
        seed=5,
        extra_body={"ignore_eos": True},
    )
    text = client.completions.create(**kw).choices[0].text
    # A stop string from the second half of the (seeded, so repeatable) text, not all whitespace.
    starts = [i for i in range(len(text) // 2, len(text) - 3) if text[i : i + 3].strip()]
    assert starts, f"no usable stop string in {text!r}"
    stop = text[starts[0] : starts[0] + 3]
    cut = client.completions.create(stop=[stop], **kw)
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(stop=[stop], stream=True, **kw) if c.choices
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)] == streamed


def test_16_concurrent_streams_all_complete_correctly(client: openai.OpenAI, server: Server) -> None:
    prompts = [f"Request number {i}: write about topic {i * 7}." for i in range(16)]
    lengths = [8 + (i % 5) * 6 for i in range(16)]  # different lengths: requests leave at different steps
    expected = [_chat(client, p, max_tokens=n).choices[0].message.content for p, n in zip(prompts, lengths)]

    async def run_all() -> list[str]:
        aclient = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)

        async def one(i: int) -> str:
            extra = {"speculative": {"enabled": i % 4 != 0}}  # mix rows with and without speculation
            stream = await aclient.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": prompts[i]}],
                max_tokens=lengths[i],
                temperature=0,
                stream=True,
                extra_body=extra,
            )
            return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

        try:
            return await asyncio.gather(*(one(i) for i in range(16)))
        finally:
            await aclient.close()

    got = asyncio.run(run_all())
    assert got == expected
    assert server.metric("verispec:num_requests_running") == 0


# ----- bad input -----


def _post(server: Server, body: bytes | dict, *, key: str | None = API_KEY) -> httpx.Response:
    url = server.url + "/v1/chat/completions"
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, dict):
        return httpx.post(url, json=body, headers=headers, timeout=30)
    return httpx.post(url, content=body, headers={**headers, "Content-Type": "application/json"}, timeout=30)


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"]
    return err


def test_malformed_json_is_400(server: Server) -> None:
    _error(_post(server, b'{"model": "tiny", "messages": ['), 400)


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "hi"}])
    assert "gpt-9" in exc.value.body["message"]


def test_model_may_be_left_out(server: Server) -> None:
    resp = _post(server, {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert resp.status_code == 200, resp.text
    assert resp.json()["model"] == "tiny"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 2}, "top_p"),
        ({"n": 2}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"speculative": {"num_speculative_tokens": -1}}, "speculative.num_speculative_tokens"),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_parameter_values_are_400(client: openai.OpenAI, extra: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], extra_body=extra
        )
    assert exc.value.body["param"] == param
    assert exc.value.body["type"] == "invalid_request_error"


def test_prompt_over_context_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model="tiny", prompt="word " * (MAX_MODEL_LEN + 10), max_tokens=4)
    assert exc.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):  # prompt fits, prompt + max_tokens does not
        client.completions.create(model="tiny", prompt="word " * 100, max_tokens=MAX_MODEL_LEN)


def test_oversized_body_is_413(server: Server) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x" * (BODY_LIMIT + 1)}]}
    _error(_post(server, body), 413)


def test_missing_or_wrong_api_key_is_401(server: Server) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    _error(_post(server, body, key=None), 401)
    _error(_post(server, body, key="sk-wrong"), 401)
    wrong = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    assert httpx.get(f"{server.url}/health").status_code == 200  # health and metrics need no key


# ----- robustness -----


def test_disconnect_mid_stream_cancels_and_frees_the_slot(server: Server, client: openai.OpenAI) -> None:
    aborted = server.metric("verispec:request_success_total", 'finished_reason="abort"')
    body = {
        "model": "tiny",
        "prompt": "Once upon a time",
        "max_tokens": 200,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "speculative": {"enabled": False},
    }
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=30,
    ) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(3)]
        assert got[0].startswith("data: ")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if server.metric("verispec:request_success_total", 'finished_reason="abort"') > aborted:
            break
        time.sleep(0.1)
    assert server.metric("verispec:request_success_total", 'finished_reason="abort"') == aborted + 1
    assert server.metric("verispec:num_requests_running") == 0
    assert _chat(client, "still there?", max_tokens=3).usage.completion_tokens <= 3


def test_failure_of_one_request_leaves_the_others_running() -> None:
    """In process: a batched step that fails because of one row is retried row by row; only that
    row's request fails."""
    from conftest import tiny_llama

    from verispec.api import as_kvmodel
    from verispec.engine import Engine
    from verispec.entrypoints.openai.metrics import ServerMetrics
    from verispec.entrypoints.openai.scheduler import Scheduler, ServerRequest

    poison = 13

    class FaultyEngine(Engine):
        def step(self, seqs):
            if any(s.tokens[0] == poison for s in seqs):
                raise RuntimeError("injected fault")
            return super().step(seqs)

    from verispec.config import GenerationConfig, SamplingConfig

    target = as_kvmodel(tiny_llama(vocab_size=64), fresh=True)
    target.reset(4)
    engine = FaultyEngine(target, None)
    sched = Scheduler(engine, 4, ServerMetrics("toy"))
    sched.start()

    async def go() -> list:
        loop = asyncio.get_running_loop()
        config = GenerationConfig(max_new_tokens=6, sampling=SamplingConfig(temperature=0), ignore_eos=True)
        reqs = [
            ServerRequest(
                seq=engine.new_sequence([first, 5, 6], config), loop=loop, queue=asyncio.Queue(), k=0
            )
            for first in (3, poison, 4)
        ]
        for r in reqs:
            sched.submit(r)
        finals = []
        for r in reqs:
            while (u := await asyncio.wait_for(r.queue.get(), 30)).finish_reason is None:
                pass
            finals.append(u)
        return finals

    try:
        ok1, bad, ok2 = asyncio.run(go())
    finally:
        sched.stop()
    assert bad.finish_reason == "error" and "injected fault" in bad.error
    assert ok1.finish_reason == ok2.finish_reason == "length"
    assert ok1.completion_tokens == ok2.completion_tokens == 6


def test_200_requests_in_a_row_without_memory_growth(server: Server, client: openai.OpenAI) -> None:
    for i in range(20):
        client.completions.create(model="tiny", prompt=f"warm up {i}", max_tokens=4)
    before = server.rss()
    for i in range(200):
        stream = i % 2 == 0
        out = client.completions.create(
            model="tiny",
            prompt=f"request {i} " * (1 + i % 7),
            max_tokens=4,
            stream=stream,
            temperature=0.7,
            seed=i,
        )
        if stream:
            list(out)
    growth = server.rss() - before
    assert growth < RSS_GROWTH_BOUND, f"server RSS grew {growth / 2**20:.1f} MiB over 200 requests"


# ----- slow: the real default model -----


def _generate_json(prompt: str, *extra: str) -> dict:
    cmd = [
        sys.executable,
        "-m",
        "verispec.cli",
        "generate",
        prompt,
        "--json",
        "--prompt-lookup",
        "--max-new-tokens",
        "32",
        *extra,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def default_server() -> Iterator[Server]:
    # The shipped EAGLE head against the CLI's prompt lookup (the default drafter on the kernel):
    # both are exact, so greedy texts must agree.
    args = [
        "--model",
        "default",
        "--speculative-model",
        "default",
        "--max-num-seqs",
        "4",
        "--max-model-len",
        "1024",
    ]
    with Server(args, startup_s=600) as srv:
        yield srv


@pytest.mark.slow
def test_greedy_chat_equals_verispec_generate(default_server: Server) -> None:
    prompt = "Rewrite this sentence in the past tense: the cat sits on the mat and watches the birds."
    cli = _generate_json(prompt)
    c = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="none", max_retries=0, timeout=300)
    resp = c.chat.completions.create(
        model="default", messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0
    )
    assert resp.choices[0].message.content == cli["text"]
    assert resp.usage.completion_tokens == len(cli["token_ids"])
    streamed = "".join(
        ch.choices[0].delta.content or ""
        for ch in c.chat.completions.create(
            model="default",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=32,
            temperature=0,
            stream=True,
        )
        if ch.choices
    )
    assert streamed == cli["text"]


@pytest.mark.slow
def test_greedy_completion_equals_verispec_generate_raw(default_server: Server) -> None:
    prompt = 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n'
    cli = _generate_json(prompt, "--raw")
    c = openai.OpenAI(base_url=f"{default_server.url}/v1", api_key="none", max_retries=0, timeout=300)
    resp = c.completions.create(model="default", prompt=prompt, max_tokens=32, temperature=0)
    assert resp.choices[0].text == cli["text"]


@pytest.fixture(scope="module")
def lookup_server() -> Iterator[Server]:
    with Server(
        ["--model", "default", "--prompt-lookup", "--num-speculative-tokens", "4", "--max-num-seqs", "4",
         "--max-model-len", "1024"],
        startup_s=600,
    ) as srv:  # fmt: skip
        yield srv


@pytest.mark.slow
def test_seeded_sampled_lookup_answers_equal_plain_ones_under_load(lookup_server: Server) -> None:
    """Prompt lookup's drafts are point masses, so a seeded sampled answer is the one the same
    request gets with speculation off, streamed or not, while other requests share the batch."""
    c = openai.OpenAI(base_url=f"{lookup_server.url}/v1", api_key="none", max_retries=0, timeout=300)
    prompt = (
        "Copy this list exactly, one item per line: red apple, green pear, yellow banana, purple plum, "
        "red apple, green pear, yellow banana, purple plum."
    )
    kw = dict(model="default", messages=[{"role": "user", "content": prompt}], max_tokens=48, temperature=0.7,
              top_p=0.9, seed=21)  # fmt: skip
    off = c.chat.completions.create(**kw, extra_body={"speculative": {"enabled": False}})
    assert off.model_extra["speculative"]["draft_tokens"] == 0

    def others(i: int) -> None:
        c.chat.completions.create(
            model="default", messages=[{"role": "user", "content": f"Tell me a fact about the number {i}."}],
            max_tokens=40, temperature=1.0, seed=i,
        )  # fmt: skip

    with ThreadPoolExecutor(4) as pool:
        busy = [pool.submit(others, i) for i in range(3)]
        on = pool.submit(lambda: c.chat.completions.create(**kw)).result()
        for f in busy:
            f.result()
    streamed = "".join(
        ch.choices[0].delta.content or "" for ch in c.chat.completions.create(**kw, stream=True) if ch.choices
    )
    assert on.model_extra["speculative"]["accepted_tokens"] > 0
    assert on.choices[0].message.content == off.choices[0].message.content == streamed
