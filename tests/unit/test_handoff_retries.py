"""The handoff's Prefect calls (control/handoff.py) try a busy answer again, as Prefect's own
client does: a full test run saw Prefect's server answer 503 to a `mint rollback`'s
create-flow-run when its database was locked a moment too long, and the command failed. Any
other refusal fails at once. Counted in attempts, against a loopback server that answers as
told."""

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from control import handoff
from mint_core.errors import ServiceError


class _Answers(BaseHTTPRequestHandler):
    codes: ClassVar[list[int]] = []
    seen = 0

    def do_POST(self) -> None:
        type(self).seen += 1
        code = self.codes.pop(0)
        body = json.dumps({"id": "run-1"} if code == 200 else {"exception_message": "no"})
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def answering(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setattr(handoff, "BACKOFF_S", 0.0)
    _Answers.seen = 0
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/api"
    server.shutdown()
    server.server_close()


def test_a_busy_answer_is_tried_again(answering: str) -> None:
    _Answers.codes = [503, 503, 200]
    api = handoff._PrefectApi(answering, "")
    assert api.call("/deployments/d/create_flow_run", {"parameters": {}}) == {"id": "run-1"}
    assert _Answers.seen == 3


def test_busy_past_the_retries_or_any_other_refusal_fails_naming_the_answer(
    answering: str,
) -> None:
    api = handoff._PrefectApi(answering, "")
    _Answers.codes = [503] * (handoff.RETRIES + 1)
    with pytest.raises(ServiceError, match="answered 503 to /x"):
        api.call("/x", {})
    assert _Answers.seen == handoff.RETRIES + 1
    _Answers.seen, _Answers.codes = 0, [500, 200]
    with pytest.raises(ServiceError, match="answered 500 to /x"):
        api.call("/x", {})
    assert _Answers.seen == 1
