"""``write_csv``: header first, blanks for missing keys, folders made, nothing for nothing."""

from __future__ import annotations

import csv

from research.results_csv import write_csv


def test_rows_are_written_under_the_given_or_first_rows_header(tmp_path):
    out = write_csv(tmp_path / "a" / "t.csv", [{"x": 1, "y": 2}, {"x": 3}])
    assert list(csv.reader(out.open())) == [["x", "y"], ["1", "2"], ["3", ""]]
    out = write_csv(tmp_path / "u.csv", [{"y": 2}], fields=("x", "y"))
    assert list(csv.reader(out.open())) == [["x", "y"], ["", "2"]]


def test_no_rows_write_nothing_unless_a_header_is_given(tmp_path):
    assert not write_csv(tmp_path / "none.csv", []).exists()
    assert list(csv.reader(write_csv(tmp_path / "h.csv", [], fields=("x",)).open())) == [["x"]]
