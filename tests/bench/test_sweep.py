"""`make bench` numbers come from a commit: the sweep refuses uncommitted code unless told, and the report then
says so at its top."""

from __future__ import annotations

import pytest

from bench import report
from bench.serving import require_clean_commit

SUMMARY = dict(machine=dict(cpu="AMD EPYC (family 25 model 17, Zen 4)", cores=2, gpu=None, platform="Linux"),
               model="SmolLM2-135M-Instruct", target="inprocess", dataset="synthetic:seed=0",
               loadavg_before=[0.1, 0.1, 0.1])


def test_a_clean_commit_runs(capsys):
    require_clean_commit("0123abc", allow_dirty=False)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("commit", ["0123abc+dirty", None])
def test_uncommitted_code_is_refused_unless_allowed(commit, capsys):
    with pytest.raises(SystemExit, match=r"refusing to benchmark .*--allow-dirty"):
        require_clean_commit(commit, allow_dirty=False)
    require_clean_commit(commit, allow_dirty=True)
    assert "WARNING: benchmarking" in capsys.readouterr().out


def test_the_report_marks_a_dirty_tree_at_its_top():
    clean = report.header([dict(SUMMARY, git_commit="0123abc")])
    dirty = report.header([dict(SUMMARY, git_commit="0123abc"), dict(SUMMARY, git_commit="0123abc+dirty")])
    assert not any("WARNING" in line for line in clean)
    assert dirty[2].startswith("> **WARNING: not from a clean commit (0123abc+dirty)**")
