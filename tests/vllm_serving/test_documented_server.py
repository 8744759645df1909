"""The serving commands of docs/serving.md ("Running the server"), run as the page gives them.

The server command and the request are read from the page, not restated here: the server runs
in a folder holding ``outputs/demo-model`` (a small all-Trellis checkpoint with its tokenizer, as
``make demo`` writes it), with only the environment the page sets (none of the ``VLLM_*``
variables the other tests set), on a loopback port of its own (``--host``/``--port`` appended).
The completion must be ``generate()``'s greedy text.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import torch

from tests.tiny_models import tiny_model
from trellis_lm import train_tokenizer

PAGE = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
SECTION = "## Running the server"


def documented_commands() -> tuple[str, str]:
    """The section's shell blocks that start the server and send the request."""
    text = PAGE.read_text(encoding="utf-8")
    section = text[text.index(SECTION):]
    section = section[: section.find("\n## ", len(SECTION))]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.DOTALL)
    server = next(block for block in blocks if "api_server" in block)
    request = next(block for block in blocks if block.lstrip().startswith("curl"))
    return server, request


def shell_words(block: str) -> list[str]:
    return shlex.split(block.replace("\\\n", " "), comments=True)


def server_process(block: str, folder: Path, port: int) -> subprocess.Popen:
    """Start the page's command in ``folder``: leading ``NAME=value`` words go to the
    environment, ``python`` is this interpreter (the venv with vLLM)."""
    words = shell_words(block)
    env = {name: value for name, value in os.environ.items() if not name.startswith("VLLM_")}
    while re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    assert words[0] == "python", words
    command = [sys.executable, *words[1:], "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(command, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def request_of(block: str, port: int) -> urllib.request.Request:
    """The page's ``curl URL -H ... -d JSON`` as a request to ``port``."""
    words = shell_words(block)
    url = next(word for word in words if word.startswith("http://"))
    body = words[words.index("-d") + 1]
    json.loads(body)  # the page's body is JSON
    path = url.split("/", 3)[3]
    return urllib.request.Request(f"http://127.0.0.1:{port}/{path}", data=body.encode(),
                                  headers={"Content-Type": "application/json"})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(server: subprocess.Popen, port: int, seconds: float = 600) -> None:
    deadline = time.time() + seconds
    while True:
        assert server.poll() is None, server.stdout.read()
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            assert time.time() < deadline, f"the server did not start in {seconds:.0f} s"
            time.sleep(1)


def test_the_documented_server_command_answers_with_generates_text(tmp_path):
    server_block, request_block = documented_commands()
    folder = tmp_path / "outputs" / "demo-model"
    texts = [f"Return the number of {word} in the {i}-th list, or None.\n" for i in range(60)
             for word in ("items", "slots", "tokens")]
    tokenizer = train_tokenizer(texts, vocab_size=300)
    model = tiny_model(seed=5, vocab_size=len(tokenizer), hidden_size=64, num_heads=2, head_dim=32,
                       intermediate_size=96, chunk_size=5, pad_token_id=tokenizer.pad_token_id,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)

    port = free_port()
    request = request_of(request_block, port)
    sent = json.loads(request.data)
    server = server_process(server_block, tmp_path, port)
    try:
        wait_until_healthy(server, port)
        with urllib.request.urlopen(request, timeout=300) as response:
            answer = json.load(response)
    finally:
        server.terminate()
        server.wait(timeout=60)

    ids = tokenizer(sent["prompt"], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=sent["max_tokens"], do_sample=False)
    expected = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    assert len(out[0]) - ids.shape[1] > 10  # a text long enough to tell float32 from bfloat16
    # vLLM's detokenizer holds back a stream's last bytes while they form no whole character yet (a
    # byte-level tokenizer's U+FFFD when decoded alone), and the stream ends there: the rest is equal.
    assert answer["choices"][0]["text"] == expected.rstrip("\ufffd")
