"""``mpengine serve`` as a process: how the HTTP tests start it, and its command line.

``serving(...)`` starts ``mpengine serve --port 0`` with an ipc address in a temporary
directory, waits for the line naming the HTTP address, and stops it (SIGTERM) however the
test ends. The other ``test_server*``, drain and systemd tests use it.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import select
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from mpengine.cli import build_parser
from mpengine.launch import OPEN_FILES

START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 60.0


@dataclass
class Served:
    proc: subprocess.Popen
    url: str  # http://127.0.0.1:PORT
    address: str  # the engine's IPC request address
    stderr: Path

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        return self.stderr.read_text(errors="replace")[-4000:]

    def stop(self, signum: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Signal the server and return its exit status (killed if it outlives
        ``timeout``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signum)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(
                f"mpengine serve did not stop in {timeout} s:\n{self.log()}"
            ) from None


def start(
    directory: Path, *flags: str, env: dict[str, str] | None = None, new_session: bool = False
) -> Served:
    """Start ``mpengine serve`` (model ``tiny`` unless ``flags`` name one); ``new_session``:
    in a process group of its own (to signal the whole group)."""
    directory.mkdir(parents=True, exist_ok=True)
    address = f"ipc://{directory}/engine"
    model = [] if "--model" in flags else ["--model", "tiny"]
    cmd = [sys.executable, "-m", "mpengine.cli", "serve", *model, "--port", "0"]
    cmd += ["--address", address, "--log-level", "WARNING", *flags]
    stderr = directory / "serve.stderr"
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=err,
            env={**os.environ, **(env or {})},
            start_new_session=new_session,
        )
    try:
        for line in _lines(proc, time.monotonic() + START_TIMEOUT_S, stderr):
            if "HTTP API at " in line:
                url = line.split("HTTP API at ", 1)[1].split()[0].removesuffix("/v1")
                return Served(proc, url, f"{address}/requests.sock", stderr)
        raise AssertionError("unreachable")
    except BaseException:
        proc.kill()
        proc.wait(10)
        raise


def _lines(proc: subprocess.Popen, deadline: float, stderr: Path) -> Iterator[str]:
    """The lines ``proc`` prints, read from the raw pipe (a buffered reader would hide
    lines it already read from ``select``)."""
    fd = proc.stdout.fileno()
    pending = b""
    while True:
        remaining = deadline - time.monotonic()
        ready, _, _ = select.select([fd], [], [], max(0.0, remaining))
        assert ready, f"mpengine serve not ready in time; it printed {pending!r}"
        data = os.read(fd, 65536)
        assert data, f"mpengine serve exited ({proc.wait(10)}):\n{stderr.read_text()}"
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            yield line.decode()


@contextlib.contextmanager
def serving(directory: Path, *flags: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    served = start(directory, *flags, env=env)
    try:
        yield served
    finally:
        if served.proc.poll() is None:
            served.stop()


def test_serve_help_documents_the_http_flags() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    text = serve.format_help()
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--drain-timeout"):
        assert flag in text, flag
    assert "--max-num-seqs" in text  # and every engine flag


def test_port_in_use_fails_before_loading(tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "mpengine.cli", "serve", "--port", str(port)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert done.returncode != 0
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr


def test_unusable_api_keys_fail_in_one_line(tmp_path: Path) -> None:
    """An empty key would let in whoever sends an empty bearer token; an unreadable key
    file printed a traceback."""
    (tmp_path / "empty.key").write_text("\n")
    for flags, message in [
        (["--api-key-file", str(tmp_path / "empty.key")], "--api-key-file holds an empty key"),
        (["--api-key", ""], "--api-key is an empty key"),
        (["--api-key", " \n"], "--api-key is an empty key"),  # (keys are stripped)
        (["--api-key-file", str(tmp_path / "missing")], "cannot read --api-key-file"),
        (["--api-key-file", str(tmp_path)], "cannot read --api-key-file"),
    ]:
        cmd = [sys.executable, "-m", "mpengine.cli", "serve", "--port", "0", *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.returncode != 0 and message in done.stderr, (flags, done.stderr)
        assert "Traceback" not in done.stderr


def test_serve_flag_mistakes_fail_before_loading(tmp_path: Path) -> None:
    """Mistakes the command line shows are one line (or argparse's usage error) before the
    model loads: both key flags, a model swallowed by --served-model-name (it served the
    default model under the user's names), empty or repeated names, negative timeouts."""
    (tmp_path / "key").write_text("k\n")
    for flags, message, status in [
        (["--api-key", "a", "--api-key-file", str(tmp_path / "key")], "not both", 1),
        (["--served-model-name", "mine", "tiny-llama"], "put MODEL first", 1),
        (["tiny", "--served-model-name", "a", "a"], "empty or repeated names", 1),
        (["tiny", "--served-model-name", ""], "empty or repeated names", 1),
        (["--drain-timeout", "-5"], "not a duration", 2),
        (["--stall-timeout", "nan"], "not a duration", 2),
        (["--uvicorn-log-level", "bogus"], "invalid choice", 2),
    ]:
        cmd = [sys.executable, "-m", "mpengine.cli", "serve", "--port", "0", *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.returncode == status and message in done.stderr, (flags, done.stderr)
        assert "Traceback" not in done.stderr and "loaded" not in done.stderr


def test_a_vllm_deployment_starts_and_logs_its_requests(tmp_path: Path) -> None:
    """A vLLM deployment's environment and flags: the key from VLLM_API_KEY (a deployment
    keeping its key there came up open), vLLM's flags accepted (the pointless ones named in
    one note), an access line per HTTP request and, with --enable-log-requests, a line per
    engine request."""
    flags = ["--log-level", "INFO", "--enable-log-requests", "--trust-remote-code", "-tp", "1"]
    flags += ["--max-model-len", "2k", "--disable-log-stats", "--max-connections", "4"]
    flags += ["--http-head-timeout", "1", "--http-body-timeout", "1"]
    with serving(tmp_path, *flags, env={"VLLM_API_KEY": "from-env"}) as served:
        for key, status in (("wrong", 401), ("from-env", 200)):
            request = urllib.request.Request(
                served.url + "/v1/completions",
                json.dumps({"prompt": "Once upon", "max_tokens": 3}).encode(),
                {"Authorization": f"Bearer {key}", "Content-Type": "application/json"},
            )
            try:
                urllib.request.urlopen(request, timeout=30).close()
                got = 200
            except urllib.error.HTTPError as error:
                got = error.code
            assert got == status, key
        # A client sending its request's head a byte at a time is cut off after 1 s; one
        # that keeps its connection for a second request is served.
        host, port = served.url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=30) as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\n")
            start, closed = time.monotonic(), False
            while not closed and time.monotonic() - start < 10:
                try:
                    slow.sendall(b"X")  # a byte of header every 0.2 s, never the end
                except OSError:
                    break
                ready, _, _ = select.select([slow], [], [], 0.2)  # (wakes once it is closed)
                closed = bool(ready) and slow.recv(1) == b""
            assert time.monotonic() - start < 5, "a slow request head was not cut off"
        # A body that stops coming: a 408 after 1 s.
        with socket.create_connection((host, int(port)), timeout=30) as stalled:
            head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer from-env\r\n"
            stalled.sendall(f'{head}Content-Length: 100\r\n\r\n{{"prompt"'.encode())
            start = time.monotonic()
            assert stalled.recv(4096).startswith(b"HTTP/1.1 408 ")
            assert time.monotonic() - start < 5
        keep = http.client.HTTPConnection(host, int(port), timeout=30)
        for _ in range(2):
            keep.request("GET", "/health")
            assert keep.getresponse().read() == b'{"status":"ok"}'
        keep.close()
        # The open-file limit raised as an engine raises it (to OPEN_FILES, within the hard
        # limit); past 4 connections a 503 at once.
        limits = Path(f"/proc/{served.proc.pid}/limits").read_text().splitlines()
        soft, hard = next(line for line in limits if line.startswith("Max open files")).split()[3:5]
        assert int(soft) == (OPEN_FILES if hard == "unlimited" else min(OPEN_FILES, int(hard)))
        idle = [socket.create_connection((host, int(port)), timeout=30) for _ in range(3)]
        try:
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(served.url + "/health", timeout=30)
            assert refused.value.code == 503
        finally:
            for connection in idle:
                connection.close()
        assert served.stop() == 0
    log = served.stderr.read_text()
    assert log.count("mpengine: note: no effect here: --trust-remote-code") == 1, log
    assert "--disable-log-stats" in log and "--tensor-parallel-size" not in log
    assert (
        '"POST /v1/completions HTTP/1.1" 401 ' in log
        and '"POST /v1/completions HTTP/1.1" 200 ' in log
    )
    assert (
        "request cmpl-" in log and '"max_tokens":3' in log
    )  # (the refused one: no engine request)
    assert log.count("request cmpl-") == 1


def test_http_connections_send_without_nagle_delay() -> None:
    """Accepted connections have TCP_NODELAY: a stream on a kept-alive connection waited
    ~45 ms for the client's delayed ACK of the response head before its first events."""
    from mpengine.server.run import _listen

    with (
        _listen("127.0.0.1", 0) as listener,
        socket.create_connection(listener.getsockname(), timeout=10),
    ):
        accepted, _ = listener.accept()
        with accepted:
            assert accepted.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)


@pytest.mark.skipif(not socket.has_dualstack_ipv6(), reason="no dual-stack IPv6 here")
def test_every_ipv6_address_takes_ipv4_too() -> None:
    """``--host ::`` listens on IPv4 as well (as vLLM's server does); ``[::1]`` is a host."""
    from mpengine.server.run import _listen

    with _listen("::", 0) as listener:
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass
    with _listen("[::1]", 0) as listener:
        assert listener.family == socket.AF_INET6


def test_https_with_a_key_and_certificate(tmp_path: Path) -> None:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: no certificate to test with")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    request = ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
    subprocess.run(
        [openssl, *request, "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    tls = ["--ssl-keyfile", str(key), "--ssl-certfile", str(cert)]
    with serving(tmp_path / "served", *tls) as served:
        assert served.url.startswith("https://127.0.0.1:")
        insecure = ssl.create_default_context()
        insecure.check_hostname, insecure.verify_mode = False, ssl.CERT_NONE
        with urllib.request.urlopen(served.url + "/health", timeout=30, context=insecure) as reply:
            assert reply.status == 200
    for flags, message in [
        (tls[:2], "needs both"),
        (["--ssl-keyfile", str(cert), "--ssl-certfile", str(cert)], "cannot load the TLS"),
    ]:
        cmd = [sys.executable, "-m", "mpengine.cli", "serve", "--port", "0", *flags]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.returncode != 0 and message in done.stderr, (flags, done.stderr)
        assert "Traceback" not in done.stderr


def test_chat_template_flag_replaces_the_models(tmp_path: Path) -> None:
    """``--chat-template FILE`` renders chats (here one looping over content parts, which
    gets OpenAI's parts); a missing file or a broken template fails before the model loads."""
    template = tmp_path / "parts.jinja"
    template.write_text(
        "{% for m in messages %}<{{ m.role }}>{% for p in m.content %}{{ p.text }};{% endfor %}"
        "{% endfor %}"
    )
    with serving(tmp_path / "served", "--chat-template", str(template)) as served:

        def tokenize(body: dict) -> list[int]:
            request = urllib.request.Request(
                served.url + "/tokenize",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(request, timeout=30) as reply:
                return json.load(reply)["tokens"]

        chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
        want = tokenize({"prompt": "<user>hi;<assistant>yo;", "add_special_tokens": False})
        assert tokenize({"messages": chat}) == want
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    for value, message in [
        (str(tmp_path / "missing.jinja"), "looks like a path, but no such file exists"),
        (str(tmp_path / "broken.jinja"), "does not compile"),
    ]:
        cmd = [sys.executable, "-m", "mpengine.cli", "serve", "--port", "0"]
        cmd += ["--chat-template", value]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert done.returncode != 0 and message in done.stderr, (value, done.stderr)
        assert "Traceback" not in done.stderr


@pytest.mark.parametrize("name", ["testorg/not-cached", "./not/a/dir"])
def test_unknown_model_path_fails_clearly(tmp_path: Path, name: str) -> None:
    from mpengine.models.resolve import resolve_model

    env = {"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():
            patch.setenv(key, value)
        with pytest.raises(FileNotFoundError, match="not a Hugging Face hub model"):
            resolve_model(name)


def test_a_model_path_that_is_no_directory_fails_before_any_stage_starts(
    tmp_path: Path,
) -> None:
    """Found by the launcher at once; the executor found it after the stages' start-up."""
    import mpengine

    for flags, message in [
        ({"model": str(tmp_path / "nosuch")}, "model directory"),
        ({"model": "tiny", "tokenizer": "./no/tokenizer"}, "tokenizer directory"),
    ]:
        start = time.monotonic()
        with pytest.raises(mpengine.EngineStartError, match=f"{message} .* does not exist"):
            mpengine.launch(**flags)
        assert time.monotonic() - start < 3
