"""runs_folder: a report reads per-run folders from the folder itself or from runs.tar.gz."""

import json
import tarfile

from research.runs_archive import ARCHIVE, runs_folder


def _write_run(root, name, acc):
    d = root / name / "cell" / "seed0"
    d.mkdir(parents=True)
    (d / "results.json").write_text(json.dumps({"final_accuracy": acc}))


def test_the_archive_is_read_when_the_folder_is_missing(tmp_path):
    src = tmp_path / "src"
    _write_run(src, "runs", 0.5)
    _write_run(src, "tuning_runs", 0.25)
    res = tmp_path / "results"
    res.mkdir()
    with tarfile.open(res / ARCHIVE, "w:gz") as tar:
        tar.add(src / "runs", arcname="runs")
        tar.add(src / "tuning_runs", arcname="tuning_runs")
    runs = runs_folder(res)
    assert runs != res / "runs" and not (res / "runs").exists()
    assert json.loads((runs / "cell" / "seed0" / "results.json").read_text())["final_accuracy"] == 0.5
    tuning = runs_folder(res, "tuning_runs")
    assert json.loads((tuning / "cell" / "seed0" / "results.json").read_text())["final_accuracy"] == 0.25
    assert runs_folder(res) == runs  # extracted once per process


def test_an_existing_folder_wins_and_nothing_gives_the_missing_folder(tmp_path):
    _write_run(tmp_path, "runs", 0.75)
    assert runs_folder(tmp_path) == tmp_path / "runs"
    assert runs_folder(tmp_path, "runs_interleaved") == tmp_path / "runs_interleaved"
    assert not runs_folder(tmp_path / "empty").exists()
