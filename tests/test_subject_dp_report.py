"""The subject-level report keeps test runs at different learning rates apart, and
draws one alpha-sweep series per learning rate."""

from __future__ import annotations

import csv
import json

from .helpers import load_example


def _report():
    return load_example("subject_dp/report.py", "sdp_report")


def _doc(run: str, alpha: float, lr: float, acc: float, evaluate_on: str = "test") -> dict:
    row = {"run": run, "method": "higradavg-dp", "alpha": alpha, "learning_rate": lr,
           "evaluate_on": evaluate_on, "seed": 0, "acc_final": acc, "noise_multiplier": 50.0,
           "epsilon": 4.0}
    return {"row": row, "history": [{"round": 1, "accuracy": acc}],
            "group_size_histogram": {"3": 2}, "distinct_subjects_histogram": {"100": 2}}


def _sized_doc(run: str, batch: int, alpha: float, acc: float, lr: float,
               evaluate_on: str = "validation", seed: int = 0) -> dict:
    """A run file with its subject batch (``run_config["batch-size"]``) and seed."""
    d = _doc(run, alpha, lr, acc, evaluate_on)
    d["row"]["seed"] = seed
    d["run_config"] = {"batch-size": batch}
    return d


def test_runs_at_two_learning_rates_are_both_kept(tmp_path):
    report = _report()
    for name, doc in {"h_alpha1.json": _doc("higradavg-exact", 1.0, 0.2, 0.10),
                      "h_alpha1_lr0.05.json": _doc("higradavg-exact", 1.0, 0.05, 0.15),
                      "h_alpha1_val_lr0.8.json": _doc("higradavg-exact", 1.0, 0.8, 0.05, "validation")}.items():
        (tmp_path / name).write_text(json.dumps(doc))
    runs = report.load_runs(tmp_path, "femnist")
    assert set(runs) == {("higradavg-exact", 1.0, 0.2), ("higradavg-exact", 1.0, 0.05)}
    report.plot_accuracy(runs, tmp_path / "acc.png", "t")
    assert (tmp_path / "acc.png").stat().st_size > 0


def test_alpha_sweep_keeps_learning_rates_apart(tmp_path):
    report = _report()
    rows = [{"run": "local-item-dp", "alpha": a, "learning_rate": lr, "acc_mean": acc}
            for a, lr, acc in [(1.0, 0.2, 0.40), (4.0, 0.2, 0.41), (1.0, 3.2, 0.73), (4.0, 3.2, 0.71),
                               (1.0, 0.05, 0.25)]]
    series = report.alpha_series(rows)
    # one series per rate; the rate that ran at one alpha only is no sweep
    assert series == {"local-item-dp (lr 0.2)": [(1.0, 0.40, 0.0), (4.0, 0.41, 0.0)],
                      "local-item-dp (lr 3.2)": [(1.0, 0.73, 0.0), (4.0, 0.71, 0.0)]}
    assert report.plot_alpha(rows, tmp_path / "a.png")
    assert not report.plot_alpha(rows[4:], tmp_path / "b.png")


def test_the_chosen_rate_sweep_joins_one_method_across_its_rates_and_skips_untested_choices(tmp_path):
    report = _report()
    methods = [{"run": "local-group-dp", "alpha": a, "learning_rate": lr, "test_seeds": k, "test_mean": m,
                "test_std": sd} for a, lr, k, m, sd in [(1.0, 0.2, 3, 0.34, 0.07), (8.0, 0.05, 2, 0.12, 0.0),
                                                        (16.0, 0.05, 0, "", "")]]
    rates = [{"run": "higradavg-subject-sampling-b128", "alpha": 1.0, "batch": 128, "learning_rate": 0.1,
              "test_seeds": 2, "test_mean": 0.25, "test_std": 0.01},
             {"run": "higradavg-subject-sampling", "alpha": 2.0, "batch": 256, "learning_rate": 0.1,
              "test_seeds": 2, "test_mean": 0.23, "test_std": 0.01}]
    series = report.alpha_series(report.chosen_rows(methods, rates))
    assert series == {"local-group-dp (rate chosen on validation)": [(1.0, 0.34, 0.07), (8.0, 0.12, 0.0)],
                      "higradavg-subject-sampling (batch and rate chosen per alpha)": [(1.0, 0.25, 0.01),
                                                                                       (2.0, 0.23, 0.01)]}
    assert report.plot_alpha(report.chosen_rows(methods, rates), tmp_path / "c.png")


def test_seeds_are_averaged_and_their_spread_reaches_the_alpha_sweep():
    report = _report()
    rows = [{"run": "fedavg", "alpha": a, "learning_rate": 0.2, "acc_final": acc, "seed": k}
            for a, k, acc in [(1.0, 0, 0.70), (1.0, 1, 0.80), (1.0, 2, 0.75), (4.0, 0, 0.60)]]
    agg = {float(r["alpha"]): r for r in report.aggregate(rows)}
    assert agg[1.0]["seeds"] == 3 and abs(agg[1.0]["acc_mean"] - 0.75) < 1e-12
    assert abs(agg[1.0]["acc_std"] - 0.05) < 1e-12  # sample std of 0.70, 0.80, 0.75
    assert agg[4.0]["seeds"] == 1 and agg[4.0]["acc_std"] == 0.0
    series = report.alpha_series(list(agg.values()))
    assert series["fedavg (lr 0.2)"][0] == (1.0, agg[1.0]["acc_mean"], agg[1.0]["acc_std"])


def test_subject_batch_is_chosen_on_validation_and_reported_on_test():
    """The batch with the best validation accuracy is chosen per alpha, whatever the
    test accuracy says; its test seeds are averaged; other rates and methods are ignored."""
    report = _report()

    def doc(run, batch, alpha, acc, evaluate_on="test", seed=0, lr=0.1):
        return _sized_doc(run, batch, alpha, acc, lr, evaluate_on, seed)

    docs = [doc("higradavg-subject-sampling-b64", 64, 4.0, 0.30, "validation"),
            doc("higradavg-subject-sampling", 256, 4.0, 0.20, "validation"),
            doc("higradavg-subject-sampling", 256, 4.0, 0.99, "validation", lr=0.4),  # other rate
            doc("higradavg-exact", 256, 4.0, 0.99, "validation"),  # other method
            doc("higradavg-subject-sampling-b64", 64, 4.0, 0.10),  # test: worse, still chosen
            doc("higradavg-subject-sampling-b64", 64, 4.0, 0.14, seed=1),
            doc("higradavg-subject-sampling", 256, 4.0, 0.50),
            doc("higradavg-subject-sampling", 256, 8.0, 0.25, "validation")]  # one batch: no choice
    rows = report.batch_choice(docs)
    assert len(rows) == 1
    row = rows[0]
    assert (row["alpha"], row["batch"], row["run"], row["test_seeds"]) == (4.0, 64, "higradavg-subject-sampling-b64", 2)
    assert abs(row["test_mean"] - 0.12) < 1e-9 and row["validation"] == "64:0.3000 256:0.2000"


def test_a_tie_on_validation_goes_to_the_larger_batch():
    report = _report()
    docs = [_sized_doc(run, batch, 16.0, 0.1181, 0.1)
            for run, batch in [("higradavg-subject-sampling", 256), ("higradavg-subject-sampling-b128", 128)]]
    for order in (docs, docs[::-1]):
        assert report.batch_choice(order)[0]["batch"] == 256


def test_learning_rate_is_chosen_on_validation_at_the_chosen_batch():
    """Stage two: at each alpha's chosen batch, the rate with the best validation
    accuracy wins whatever test says; other batches' rates are ignored; an alpha with
    one validated rate at its chosen batch is left out; a tie keeps the stage-one rate."""
    report = _report()
    doc = _sized_doc
    b128, b256 = "higradavg-subject-sampling-b128", "higradavg-subject-sampling"
    docs = [doc(b128, 128, 4.0, 0.30, 0.1), doc(b256, 256, 4.0, 0.20, 0.1),  # batch 128 chosen
            doc(b128, 128, 4.0, 0.35, 0.05), doc(b128, 128, 4.0, 0.25, 0.2),
            doc(b256, 256, 4.0, 0.90, 0.2),  # another batch's rate: ignored
            doc(b128, 128, 4.0, 0.10, 0.05, "test"), doc(b128, 128, 4.0, 0.12, 0.05, "test", seed=1),
            doc(b128, 128, 4.0, 0.60, 0.2, "test"),  # test prefers 0.2: no say
            doc(b128, 128, 8.0, 0.20, 0.1), doc(b256, 256, 8.0, 0.30, 0.1),  # batch 256 chosen
            doc(b256, 256, 8.0, 0.30, 0.2),  # tie with the stage-one rate
            doc(b128, 128, 1.0, 0.30, 0.1), doc(b256, 256, 1.0, 0.20, 0.1),
            doc(b256, 256, 1.0, 0.50, 0.2)]  # alpha 1: one rate at the chosen 128
    batches = report.batch_choice(docs)
    assert [(r["alpha"], r["batch"]) for r in batches] == [(1.0, 128), (4.0, 128), (8.0, 256)]
    rates = {r["alpha"]: r for r in report.learning_rate_choice(docs, batches)}
    assert set(rates) == {4.0, 8.0}
    assert (rates[4.0]["learning_rate"], rates[4.0]["test_seeds"]) == (0.05, 2)
    assert abs(rates[4.0]["test_mean"] - 0.11) < 1e-9 and rates[4.0]["validation"] == "0.05:0.3500 0.1:0.3000 0.2:0.2500"
    assert rates[8.0]["learning_rate"] == 0.1 and rates[8.0]["test_seeds"] == 0
    # the tie is decided by the rule, not by the order of the run files
    rates_rev = {r["alpha"]: r for r in report.learning_rate_choice(docs[::-1], batches)}
    assert rates_rev[8.0]["learning_rate"] == 0.1 and rates_rev[4.0]["learning_rate"] == 0.05


def test_validation_is_averaged_over_the_seeds_every_candidate_ran():
    """With two validation seeds the choice follows the mean, not seed 0; a seed that
    only one candidate ran is left out of every candidate's mean; the same holds for
    the learning-rate stage."""
    report = _report()
    b128, b256 = "higradavg-subject-sampling-b128", "higradavg-subject-sampling"
    docs = [_sized_doc(b128, 128, 8.0, 0.30, 0.1, seed=0), _sized_doc(b128, 128, 8.0, 0.10, 0.1, seed=1),
            _sized_doc(b256, 256, 8.0, 0.25, 0.1, seed=0), _sized_doc(b256, 256, 8.0, 0.25, 0.1, seed=1),
            _sized_doc(b256, 256, 8.0, 0.00, 0.1, seed=2),  # only batch 256 ran seed 2: ignored
            # rates at the chosen 256: seed 0 prefers 0.05, the two-seed mean prefers 0.2
            _sized_doc(b256, 256, 8.0, 0.40, 0.05, seed=0), _sized_doc(b256, 256, 8.0, 0.10, 0.05, seed=1),
            _sized_doc(b256, 256, 8.0, 0.30, 0.2, seed=0), _sized_doc(b256, 256, 8.0, 0.30, 0.2, seed=1),
            # alpha 16: the two batches share no validation seed, so nothing is chosen
            _sized_doc(b128, 128, 16.0, 0.30, 0.1, seed=0), _sized_doc(b256, 256, 16.0, 0.20, 0.1, seed=1)]
    batches = report.batch_choice(docs)
    assert [(r["alpha"], r["batch"], r["validation_seeds"]) for r in batches] == [(8.0, 256, 2)]
    assert batches[0]["validation"] == "128:0.2000 256:0.2500"
    rates = report.learning_rate_choice(docs, batches)
    assert [(r["learning_rate"], r["validation_seeds"]) for r in rates] == [(0.2, 2)]
    assert rates[0]["validation"] == "0.05:0.2500 0.1:0.2500 0.2:0.3000"


def test_other_methods_rate_is_screened_on_seed_0_then_chosen_on_the_finalists_mean():
    """Per run at alpha 1: the rates re-run on more seeds are the finalists and their
    mean decides, even against a better seed-0 screen of a rate run once; test has no
    say; the subject-sampled family, other alphas and a run with one rate are left
    out; an exact tie goes to the tested rate."""
    report = _report()
    doc = _sized_doc
    docs = [doc("local-item-dp", 0, 1.0, 0.60, 0.8), doc("local-item-dp", 0, 1.0, 0.72, 1.6),
            doc("local-item-dp", 0, 1.0, 0.70, 3.2),
            doc("local-item-dp", 0, 1.0, 0.62, 1.6, seed=1), doc("local-item-dp", 0, 1.0, 0.70, 3.2, seed=1),
            doc("local-item-dp", 0, 1.0, 0.10, 3.2, "test"), doc("local-item-dp", 0, 1.0, 0.20, 3.2, "test", seed=1),
            doc("local-item-dp", 0, 1.0, 0.99, 1.6, "test"),  # test prefers 1.6: no say
            doc("local-item-dp", 0, 4.0, 0.99, 0.8),  # another alpha
            doc("user-ldp", 0, 1.0, 0.009, 0.05), doc("user-ldp", 0, 1.0, 0.009, 0.2),
            doc("user-ldp", 0, 1.0, 0.011, 0.2, "test"),
            doc("fedavg", 0, 1.0, 0.70, 0.2),  # one rate: nothing chosen
            doc("higradavg-subject-sampling-b128", 128, 1.0, 0.30, 0.1),
            doc("higradavg-subject-sampling-b128", 128, 1.0, 0.20, 0.2)]
    for order in (docs, docs[::-1]):
        rows = {r["run"]: r for r in report.method_rate_choice(order)}
        assert set(rows) == {"local-item-dp", "user-ldp"}
        lid = rows["local-item-dp"]
        assert (lid["learning_rate"], lid["validation_seeds"], lid["test_seeds"]) == (3.2, 2, 2)
        assert lid["screen"] == "0.8:0.6000 1.6:0.7200 3.2:0.7000" and lid["finalists"] == "1.6:0.6700 3.2:0.7000"
        assert abs(lid["test_mean"] - 0.15) < 1e-9
        assert (rows["user-ldp"]["learning_rate"], rows["user-ldp"]["validation_seeds"]) == (0.2, 1)
    # a tie with no tested rate goes to the smaller rate, whatever the file order
    untested = [doc("user-ldp", 0, 1.0, 0.009, 0.8), doc("user-ldp", 0, 1.0, 0.009, 0.2)]
    for order in (untested, untested[::-1]):
        assert report.method_rate_choice(order)[0]["learning_rate"] == 0.2


def test_a_run_file_with_only_its_run_config_naming_shakespeare_is_not_femnist(tmp_path):
    """Early Shakespeare validation files carry the data set in ``run_config`` only:
    they must not enter FEMNIST's learning-rate choice."""
    report = _report()
    (tmp_path / "runs").mkdir()
    for k, (lr, acc, rc) in enumerate([(0.2, 0.50, {"batch-size": 0}), (0.8, 0.40, {"batch-size": 0}),
                                        (4.0, 0.90, {"batch-size": 0, "dataset": "shakespeare"})]):
        d = _sized_doc("fedavg", 0, 1.0, acc, lr)
        d["run_config"] = rc
        (tmp_path / "runs" / f"run{k}.json").write_text(json.dumps(d))
    _, _, methods = report.write_choices(tmp_path / "runs", tmp_path)
    assert [(r["run"], r["learning_rate"], r["screen"]) for r in methods] == [("fedavg", 0.2, "0.2:0.5000 0.8:0.4000")]
    assert (tmp_path / "method_learning_rate_choice.csv").exists()


def test_the_method_rate_choice_file_covers_every_alpha_with_two_validated_rates(tmp_path):
    """``method_learning_rate_choice.csv`` holds one choice per run and alpha where two or
    more rates were validated (alpha 1 and 16 here), each made on that alpha's runs only;
    an alpha with one validated rate (4) is left out."""
    report = _report()
    (tmp_path / "runs").mkdir()
    docs = [_sized_doc("local-item-dp", 0, 1.0, 0.70, 3.2), _sized_doc("local-item-dp", 0, 1.0, 0.60, 1.6),
            _sized_doc("local-item-dp", 0, 16.0, 0.50, 3.2), _sized_doc("local-item-dp", 0, 16.0, 0.55, 1.6),
            _sized_doc("local-item-dp", 0, 4.0, 0.90, 6.4)]
    for k, d in enumerate(docs):
        (tmp_path / "runs" / f"run{k}.json").write_text(json.dumps(d))
    _, _, methods = report.write_choices(tmp_path / "runs", tmp_path)
    assert [(r["alpha"], r["learning_rate"]) for r in methods] == [(1.0, 3.2), (16.0, 1.6)]
    with (tmp_path / "method_learning_rate_choice.csv").open() as f:
        assert [(row["alpha"], row["learning_rate"]) for row in csv.DictReader(f)] == [("1.0", "3.2"), ("16.0", "1.6")]


def test_a_run_tested_but_not_searched_at_an_alpha_carries_alpha_one_s_choice(tmp_path):
    """LocalGroupDP with G = 1 was searched at alpha 1 (0.2 chosen) and tested at alpha 8
    without a search there: its alpha-8 row carries 0.2, says so, and summarises only the
    test runs at 0.2 (not the one at 0.05). An alpha with a search of its own (16) keeps
    its own choice, and validation runs never count as tests."""
    report = _report()
    (tmp_path / "runs").mkdir()
    run = "local-group-dp-g1"
    docs = [_sized_doc(run, 0, 1.0, 0.20, 0.2), _sized_doc(run, 0, 1.0, 0.15, 0.1),
            _sized_doc(run, 0, 1.0, 0.22, 0.2, "test"),
            _sized_doc(run, 0, 8.0, 0.19, 0.2, "test"), _sized_doc(run, 0, 8.0, 0.18, 0.2, "test", seed=1),
            _sized_doc(run, 0, 8.0, 0.90, 0.05, "test"), _sized_doc(run, 0, 8.0, 0.95, 0.2),
            _sized_doc(run, 0, 16.0, 0.10, 0.2), _sized_doc(run, 0, 16.0, 0.12, 0.1),
            _sized_doc(run, 0, 16.0, 0.11, 0.1, "test")]
    for k, d in enumerate(docs):
        (tmp_path / "runs" / f"run{k}.json").write_text(json.dumps(d))
    _, _, methods = report.write_choices(tmp_path / "runs", tmp_path)
    got = [(r["alpha"], r["learning_rate"], r["chosen_at_alpha"], r["test_seeds"], r["test_mean"]) for r in methods]
    assert got == [(1.0, 0.2, 1.0, 1, 0.22), (8.0, 0.2, 1.0, 2, 0.185), (16.0, 0.1, 16.0, 1, 0.11)]
    assert methods[1]["screen"] == "" and methods[1]["validation_seeds"] == 0
    series = report.alpha_series(report.chosen_rows(methods, []))
    assert series == {f"{run} (rate chosen on validation)": [(1.0, 0.22, 0.0), (8.0, 0.185, 0.0071), (16.0, 0.11, 0.0)]}
