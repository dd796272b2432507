"""bench.ab's closing table: each row's first decimal number per tree, its median over rounds, after / before."""

from bench.ab import first_numbers, summary

OUT = """machine: AMD EPYC, 2 cores
op                        dtype          ours      torch  torch/ours
decode_attention 8 seqs   float32       {t}      0.734        4.1x   (200..1100 cached tokens)
# a comment 1.5
  indented 2.5
"""


def test_first_numbers_reads_rows_that_start_with_text() -> None:
    assert first_numbers(OUT.format(t="0.177")) == {"decode_attention 8 seqs float32": 0.177}


def test_summary_is_the_median_per_tree_and_the_ratio() -> None:
    samples = {"before": {"row": [1.0, 3.0, 2.0]}, "after": {"row": [1.0, 1.0, 4.0], "only after": [1.0]}}
    lines = summary(samples)
    assert lines[-1].split() == ["row", "2", "1", "0.500"]
    assert not any("only after" in line for line in lines)
