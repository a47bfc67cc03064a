"""`hexgen-flow profile` through the real CLI: its option and connection errors (exit 2, one
line). Runs against a server, and the errors only a server can cause, are in
tests/real_engine/test_profile_real_server.py, against real vLLM (no stand-in server here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hexgen_cli.main import main
from hexgen_launch.processes import free_port


def _dead_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["profile", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def base(url: str, out: Path, model: str = "smollm2-135m") -> list[str]:
    return ["--openai-url", url, "--model", model, "--gpu", "A100", "--out", str(out)]


def one_error_line(err: str) -> str:
    assert err.startswith("hexgen-flow: error: "), err
    assert err.count("\n") == 1, err
    return err


def test_server_down_exits_2_on_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, out, err = run(capsys, *base(_dead_url(), tmp_path / "p.yaml"))
    assert code == 2 and out == ""
    assert "cannot reach" in one_error_line(err)
    assert not (tmp_path / "p.yaml").exists()


def test_a_bad_url_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, _, err = run(capsys, *base("not a url", tmp_path / "p.yaml"))
    assert code == 2
    one_error_line(err)


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--batches", "2,4"], "--batches must hold 1 and a larger batch"),
        (["--batches", "1"], "--batches must hold 1 and a larger batch"),
        (["--batches", "1,x"], "expected integers"),
        (["--input-tokens", "0,64"], "expected integers >= 1"),
        (["--repeats", "0"], "must be >= 1"),
        (["--precision", "fp4"], "invalid choice"),
        (["--profile-model", "no-such-model"], "unknown model 'no-such-model'"),
    ],
)
def test_bad_options_exit_2_before_any_request(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, extra: list[str], says: str
) -> None:
    code, _, err = run(capsys, *base(_dead_url(), tmp_path / "p.yaml"), *extra)
    assert code == 2
    assert says in one_error_line(err)


def test_required_options(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "--openai-url", "http://127.0.0.1:1", "--model", "m")
    assert code == 2
    assert "required" in one_error_line(err)


def test_an_out_folder_that_does_not_exist(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, _, err = run(capsys, *base(_dead_url(), tmp_path / "no" / "p.yaml"))
    assert code == 2
    assert "no folder" in one_error_line(err)
