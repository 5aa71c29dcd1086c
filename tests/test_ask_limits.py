"""`medgraph ask` limits (issue 17, fault 6): a time limit for the whole call, a question length limit, the
question from a file or standard input, one exit status for empty input, validated `--set` values, and
the warehouse free for writers while the LLM is thinking. Against a real HTTP server on loopback."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import duckdb
import pytest
from conftest import REPO_ROOT, copy_warehouse

from medgraph.cli import main
from medgraph.storage import Warehouse


@contextmanager
def llm_server(reply: Callable[[dict], str | None]) -> Iterator[tuple[str, list[dict]]]:
    """An OpenAI-compatible `/v1/chat/completions` server on loopback: `reply(request)` is the answer text;
    None accepts the request and never answers. Yields (the `--llm` spec, the requests received)."""
    received: list[dict] = []
    released = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            received.append(request)
            text = reply(request)
            if text is None:
                released.wait(300)
                return
            body = json.dumps({"model": request["model"], "usage": {"prompt_tokens": 10, "completion_tokens": 3},
                               "choices": [{"message": {"content": text}, "finish_reason": "stop"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"openai:test-model@http://127.0.0.1:{server.server_address[1]}/v1", received
    finally:
        released.set()
        server.shutdown()
        server.server_close()


@pytest.fixture
def bare_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """MEDGRAPH_HOME with an empty warehouse: enough for `--method cot`, which retrieves nothing (and so
    never loads the encoder)."""
    home = tmp_path / "home"
    home.mkdir()
    duckdb.connect(str(home / "warehouse.duckdb")).close()
    monkeypatch.setenv("MEDGRAPH_HOME", str(home))
    return home


@pytest.fixture
def no_model(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Any attempt to load an LLM or the encoder fails the test: errors must come before that."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setenv("MEDGRAPH_HOME", str(tmp_path / "empty_home"))
    monkeypatch.setattr("medgraph.llm.load_llm", refuse)
    monkeypatch.setattr("medgraph.embed.encoder.load_encoder", refuse)


# --------------------------------------------------------------------------- time limit


def test_a_server_that_never_answers_ends_in_about_the_timeout(bare_home: Path, capsys: pytest.CaptureFixture):
    """Before: 5 attempts x 120 s read timeouts (610 s) and no option to shorten it."""
    import medgraph.methods  # noqa: F401 - imported beforehand, so the 3 s are spent waiting on the server

    with llm_server(lambda request: None) as (spec, received):
        started = time.monotonic()
        code = main(["ask", "Which drug treats hypertension?", "--method", "cot", "--llm", spec, "--timeout", "3"])
        elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 124 and received  # the request reached the server, which never answered
    assert "no answer within the time limit of 3 s (--timeout)" in err and "--timeout SECONDS" in err
    assert elapsed < 3 + 4


def test_http_requests_end_at_the_deadline_without_a_signal():
    """The HTTP backend's own part: each request waits at most until `deadline`, and no retry starts after
    it (a thread that is not the main one gets no SIGALRM)."""
    from medgraph.llm import user
    from medgraph.llm.openai_http import LlmRequestError, OpenAIChatModel

    with llm_server(lambda request: None) as (spec, received):
        model = OpenAIChatModel("test-model", spec.split("@", 1)[1])
        model.deadline = time.monotonic() + 2
        started = time.monotonic()
        with pytest.raises(LlmRequestError, match="no reply before the caller's time limit ran out"):
            model.generate([[user("Which drug?")]])
        assert time.monotonic() - started < 2 + 2 and len(received) == 1
        model.close()


def test_the_time_limit_names_the_stage_that_was_running(bare_home: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture):
    """Issue 30, fault 5. A registry that never answers: before, the message said "while loading the LLM"."""
    import socket

    import medgraph.methods  # noqa: F401 - imported beforehand, so the 3 s are spent waiting on the registry

    with socket.socket() as silent:  # accepts connections (the kernel's backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        uri = f"http://admin:pw@127.0.0.1:{silent.getsockname()[1]}"
        monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
        started = time.monotonic()
        code = main(["ask", "Which drug treats hypertension?", "--method", "graph-r1", "--timeout", "3"])
        elapsed = time.monotonic() - started
    err = capsys.readouterr().err
    assert code == 124 and elapsed < 3 + 4, err
    assert (f"no answer within the time limit of 3 s (--timeout) while reading the model registry "
            f"(http://admin:***@127.0.0.1:{uri.rsplit(':', 1)[1]}) for the Graph-R1 policy") in err
    assert "loading the LLM" not in err and ":pw@" not in err


@pytest.mark.parametrize("method, family", [("irag", "irag"), ("sema-rag-no-e-agent", "sema-rag"), ("rag-kg", "rag-kg"),
                                            ("cot", "cot")])
def test_the_default_time_limit_is_the_methods_usual_time_with_headroom(no_model: None, method: str, family: str,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture):
    """Before: 45 s for every method, and `ask --method irag` with its defaults took longer than that on
    2 cores. A time-out (here at once) says the limit used and how long the method usually takes."""
    from contextlib import contextmanager

    from medgraph import cli

    limits: list[float] = []

    @contextmanager
    def expires_at_once(seconds: float):
        limits.append(seconds)
        raise cli.AskTimedOut()
        yield

    monkeypatch.setattr(cli, "_time_limit", expires_at_once)
    assert main(["ask", "Which drug treats hypertension?", "--method", method]) == 124
    usual = cli.ASK_USUAL_S[family]
    assert limits == [max(cli.ASK_TIMEOUT_S, round(cli.ASK_TIMEOUT_HEADROOM * usual))]
    assert usual > 0 and (limits[0] > 45 if family == "irag" else limits[0] >= 45)
    err = capsys.readouterr().err
    assert f"time limit of {limits[0]:g} s (--timeout)" in err and f"{family} usually takes about {usual:.0f} s" in err
    assert main(["ask", "Which drug treats hypertension?", "--method", method, "--timeout", "7"]) == 124
    assert limits[-1] == 7  # a given --timeout wins


def test_timeout_is_validated(no_model: None, capsys: pytest.CaptureFixture):
    assert main(["ask", "x", "--timeout", "-1"]) == 2
    assert "--timeout must be >= 0 seconds" in capsys.readouterr().err


# --------------------------------------------------------------------------- the question


@pytest.mark.parametrize("as_json", [False, True])
def test_an_empty_question_is_exit_status_2_with_or_without_json(no_model: None, as_json: bool,
                                                                capsys: pytest.CaptureFixture):
    """Before: the whole pipeline ran; `--json` exited 0, plain output 2."""
    json_flag = ["--json"] if as_json else []
    assert main(["ask", "   ", *json_flag]) == 2
    assert "the question is empty" in capsys.readouterr().err
    assert main(["ask", *json_flag]) == 2
    assert "no question: give it as an argument, with --question-file PATH" in capsys.readouterr().err


def test_a_question_over_the_length_limit_is_refused_with_the_limit_and_how_to_raise_it(
        no_model: None, capsys: pytest.CaptureFixture):
    """Before: a 125 KB question ran for 372 s (23,713 prompt tokens) without a word."""
    assert main(["ask", "x" * 125_000]) == 2
    err = capsys.readouterr().err
    assert "the question is 125,000 characters, over the limit of 8,000" in err
    assert "raise it with --max-question-chars N" in err
    assert main(["ask", "x" * 90, "--option", "A=" + "y" * 20, "--max-question-chars", "100"]) == 2
    assert "the question with its options is 110 characters, over the limit of 100" in capsys.readouterr().err


def test_a_long_question_comes_from_a_file_or_standard_input(no_model: None, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture):
    """Before: a 200 KB question could not be passed at all (argument list too long, no stdin option).
    Past the checks, the next stop is the missing warehouse (exit 1): no model was loaded."""
    question = tmp_path / "question.txt"
    question.write_text("Which drug treats hypertension? " + "context " * 25_000, encoding="utf-8")
    assert main(["ask", "--question-file", str(question)]) == 2
    assert "characters, over the limit of 8,000" in capsys.readouterr().err
    assert main(["ask", "--question-file", str(question), "--max-question-chars", "0"]) == 1
    assert "no warehouse at" in capsys.readouterr().err
    monkeypatch.setattr(sys, "stdin", io.StringIO(question.read_text()))
    assert main(["ask", "-", "--max-question-chars", "300000"]) == 1
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n \n"))
    assert main(["ask", "--question-file", "-"]) == 2
    assert "the question is empty (standard input)" in capsys.readouterr().err
    assert main(["ask", "--question-file", str(tmp_path / "absent.txt")]) == 2
    assert "absent.txt: no such file" in capsys.readouterr().err
    assert main(["ask", "x", "--question-file", str(question)]) == 2
    assert "not both" in capsys.readouterr().err


# --------------------------------------------------------------------------- --set


@pytest.mark.parametrize(("method", "setting", "message"), [
    ("rag", "text_k=abc", "--set text_k=abc: text_k takes an integer, got 'abc'"),
    ("rag", "text_k=-3", "--set text_k=-3: text_k must be an integer >= 0, got -3"),
    ("rag", "max_new_tokens=0", "max_new_tokens must be an integer >= 1, got 0"),
    ("rag", "text_k=2.5", "text_k takes an integer"),
    ("a2rag", "tau=1.5", "--set tau=1.5: tau must be a number between 0 and 1, got 1.5"),
    ("a2rag", "use_awc=1", "use_awc takes true or false, got '1'"),
    ("a2rag", "retrieval=bfs", "retrieval takes one of 'gsrm', 'one_hop', 'edge_search', got 'bfs'"),
    ("a2rag", "max_triples_per_relation=x", "max_triples_per_relation takes an integer or null"),
    ("a2rag", "taux=1", "A2RagConfig has no field 'taux'; known: "),
    ("graph-r1", "actions=search,fly", "unknown Graph-R1 actions ['fly']"),
    ("rag", "text_k", "--set takes KEY=VALUE, got 'text_k'"),
])
def test_set_values_are_checked_against_the_configuration(no_model: None, method: str, setting: str, message: str,
                                                          capsys: pytest.CaptureFixture):
    """Before: `text_k=abc` was a raw TypeError deep in the method, `text_k=-3` was accepted."""
    assert main(["ask", "x", "--method", method, "--set", setting]) == 2
    err = capsys.readouterr().err
    assert err.startswith("medgraph ask: error: ") and message in err and "Traceback" not in err


def test_valid_set_values_are_typed(no_model: None):
    from medgraph.cli import _parse_overrides
    from medgraph.methods.a2rag import A2RagConfig
    from medgraph.methods.graph_r1 import GraphR1Config

    assert _parse_overrides(["tau=1", "max_triples_per_relation=null", "use_awc=false", "retrieval=one_hop"],
                            A2RagConfig) == {"tau": 1.0, "max_triples_per_relation": None, "use_awc": False,
                                             "retrieval": "one_hop"}
    assert _parse_overrides(["actions=search,traverse"], GraphR1Config) == {"actions": ("search", "traverse")}
    assert _parse_overrides(['actions=["analyze"]'], GraphR1Config) == {"actions": ("analyze",)}


# --------------------------------------------------------------------------- the warehouse while waiting


def test_a_writer_can_open_the_warehouse_while_rag_waits_on_the_llm(retrieval_warehouse: Warehouse, encoder,
                                                                   tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   capsys: pytest.CaptureFixture):
    """While the LLM server holds the answer call, another process opens warehouse.duckdb for writing.
    Before: `ask` kept its read-only connection for the whole run, so the writer failed on the file lock."""
    home = tmp_path / "home"
    copy_warehouse(retrieval_warehouse, home)
    monkeypatch.setenv("MEDGRAPH_HOME", str(home))
    monkeypatch.setattr("medgraph.embed.encoder.load_encoder", lambda spec, **options: encoder)
    writes: list[subprocess.CompletedProcess] = []
    writer = ("import duckdb, sys; con = duckdb.connect(sys.argv[1]); "
              "con.execute('CREATE OR REPLACE TABLE main.concurrent_write AS SELECT 1 AS x'); con.close()")

    def write_then_answer(request: dict) -> str:
        writes.append(subprocess.run([sys.executable, "-c", writer, str(home / "warehouse.duckdb")],
                                     capture_output=True, text=True, timeout=60, check=False))
        return "<answer>A</answer>"

    with llm_server(write_then_answer) as (spec, received):
        code = main(["ask", "Which drug may treat hypertension?", "--option", "A=amlodipine", "--option", "B=insulin",
                     "--method", "rag", "--llm", spec, "--json", "--timeout", "120"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["prediction"] == "A" and len(received) == 1
    assert payload["steps"][0]["retrieved_ids"]  # it did query the warehouse before the LLM call
    assert [w.returncode for w in writes] == [0], writes[0].stderr[-2000:]
    with duckdb.connect(str(home / "warehouse.duckdb"), read_only=True) as con:
        assert con.execute("SELECT x FROM main.concurrent_write").fetchall() == [(1,)]


def test_option_text_with_terminal_escapes_is_printed_escaped_on_the_answer_line(
        retrieval_warehouse: Warehouse, encoder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture):
    """An option (user text) carrying escape sequences is shown, not obeyed: the `answer:` line escapes them."""
    home = tmp_path / "home"
    copy_warehouse(retrieval_warehouse, home)
    monkeypatch.setenv("MEDGRAPH_HOME", str(home))
    monkeypatch.setattr("medgraph.embed.encoder.load_encoder", lambda spec, **options: encoder)
    with llm_server(lambda request: "<answer>A</answer>") as (spec, _):
        code = main(["ask", "Which drug may treat hypertension?", "--option", "A=\x1b[2J\x1b]0;pwned\x07amlodipine",
                     "--option", "B=insulin", "--method", "cot", "--llm", spec, "--timeout", "120"])
    out = capsys.readouterr().out
    assert code == 0 and "\x1b" not in out and "\x07" not in out
    assert "answer: A. \\x1b[2J\\x1b]0;pwned\\x07amlodipine" in out


# --------------------------------------------------------------------------- signals


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_busy_ask_exits_promptly_on_sigterm_and_sigint(signum: int, tmp_path: Path):
    """A `medgraph ask` process waiting on an LLM server that never answers ends within a few seconds
    of SIGTERM or SIGINT (and not only after its time limit)."""
    home = tmp_path / "home"
    home.mkdir()
    duckdb.connect(str(home / "warehouse.duckdb")).close()
    env = {**os.environ, "MEDGRAPH_HOME": str(home), "MEDGRAPH_PROFILE": "tiny", "HF_HUB_OFFLINE": "1"}
    with llm_server(lambda request: None) as (spec, received):
        proc = subprocess.Popen([str(Path(sys.executable).parent / "medgraph"), "ask", "Which drug?", "--method",
                                 "cot", "--llm", spec, "--timeout", "300"], cwd=REPO_ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 120
            while not received and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert received, f"the request never arrived: {proc.poll()} {proc.stdout.read() if proc.poll() else ''}"
            sent = time.monotonic()
            proc.send_signal(signum)
            proc.wait(timeout=15)
            elapsed = time.monotonic() - sent
        finally:
            if proc.poll() is None:
                proc.kill()
    assert proc.returncode in (-signum, 128 + signum) and elapsed < 5
