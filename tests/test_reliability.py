"""Every case of `reliability_cases.CASES`, run through the installed CLI (issue: never a traceback,
never a wrong answer, never a lost file). `scripts/reliability_report.py` documents the same runs."""

import pytest
import torch
from conftest import byte_tokenizer, text_of_bytes, tiny_model
from reliability_cases import CASES, make_workspace, problems, run_case


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
    found = problems(ws, case, out)
    assert not found, f"{found}\nstdout: {out.stdout[-1000:]!r}\nstderr: {out.stderr[-3000:]}"
