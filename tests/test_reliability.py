"""Every case of `reliability_cases.CASES`, run through the installed CLI (issue: never a traceback,
never a wrong answer, never a lost file). `scripts/reliability_report.py` documents the same runs."""

import pytest
import torch
from conftest import byte_tokenizer, text_of_bytes, tiny_model
from reliability_cases import CASES, make_workspace, run_case


def save_tiny_llama(path):
    tiny_model("llama", torch.float32).save_pretrained(path)
    byte_tokenizer().save_pretrained(path)


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    return make_workspace(tmp_path_factory.mktemp("reliability"), save_tiny_llama,
                          text_of_bytes(600) + "\nThe code is 4242.\n")  # fmt: skip


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test__case__clear_error_and_nothing_harmed(ws, case):
    out = run_case(ws, case)
    assert out.code == case.code, f"exit {out.code}, expected {case.code}\n{out.stderr[-3000:]}"
    assert "Traceback" not in out.stderr
    if case.code in (1, 130, 143):
        errors = [line for line in out.stderr.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1, out.stderr
        assert case.message in out.error_line, out.error_line
    if case.code == 1:
        assert out.stdout == "", "a failure printed results"
    if case.before_model:
        assert "rocketkv: loaded" not in out.stderr, f"refused only after the model loaded:\n{out.stderr[-2000:]}"
    if case.log_has:
        assert case.log_has in out.stderr, out.stderr[-3000:]
    if case.check is not None:
        case.check(ws)
