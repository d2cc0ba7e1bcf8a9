"""`tokenmill serve` against its own /openapi.json: schemathesis generates requests from the
schema (valid and invalid ones, and methods a path does not take) and checks every answer's
status, content type, headers and body against it, and that no request gets a 5xx. Bounded: a
tiny model with a 64-token context, fifteen examples per operation, one worker, a fixed seed.

Schemathesis runs as its command line: its pytest plugin (`schemathesis.pytest.from_fixture`)
sets a private attribute of pytest's test items that pytest 9 no longer has.

Not checked: that every schema-valid request is accepted (positive_data_acceptance). The schema
gives types; some rules it cannot state (a prompt and max_tokens within the context, a chat
template that renders) and some it does not (no empty prompts, a known role), and those get a 400.
"""

from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
from test_serve_cli import wait_until_up
from test_server import free_port

pytest.importorskip("schemathesis", reason="schemathesis is in the test extra")

CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,"
          "response_schema_conformance,negative_data_rejection,unsupported_method,allow_header_conformance")


def test_every_answer_agrees_with_the_openapi_schema_and_none_is_a_server_error(tiny_llama, tmp_path):
    port = free_port()
    # WARNING: a line per request would fill the pipe, which nothing reads while the server is up
    proc = subprocess.Popen([sys.executable, "-m", "tokenmill.cli", "--log-level", "WARNING", "serve", str(tiny_llama),
                             "--port", str(port), "--served-model-name", "tiny", "--num-kv-blocks", "128",
                             "--max-model-len", "64"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, url)
        paths = httpx.get(url + "/openapi.json").json()["paths"]
        run = subprocess.run([sys.executable, "-m", "schemathesis.cli", "run", url + "/openapi.json",
                              "--checks", CHECKS, "--max-examples", "15", "--seed", "35", "--workers", "1",
                              "--request-timeout", "30", "--generation-database", "none"],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path)
    finally:
        proc.terminate()
        proc.wait(30)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    operations = sum(len(methods) for methods in paths.values())  # every operation the schema lists
    assert f"Tested: {operations}" in run.stdout and " passed" in run.stdout
