"""The drop-in path: a user's own Flower app (examples/quickstart-pytorch: its own
Net, data loaders, train and test) under JointDP and JointDPClient, in process.

Checks what the drop-in issue asks: each ``start()`` argument honoured or refused
before spending; no personal value in any reply; the owner's schedule and noise
from the user's own loop; bad input (personal-layers matching nothing or
everything, initial arrays that do not match, an empty loader, a non-finite loss,
a loop that steps twice per batch) each a clear error naming the cause."""

from __future__ import annotations

import logging
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.config import flatten_dict
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from flwr_jdp.inprocess import InProcessGrid
from flwr_jdp.joint_dp import protocol
from flwr_jdp.joint_dp.client import JointDPClient
from flwr_jdp.joint_dp.config import ConfigError, namespaced_config
from flwr_jdp.strategies import JointDP, load_results
from flwr_jdp.training.user_loop import _SyntheticSet, private_training
from tests.test_owners_mod import _contains

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart-pytorch"


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from quickstart import client_app, task
    finally:
        sys.path.remove(str(EXAMPLE))
    return client_app, task


@pytest.fixture
def run_config(tmp_path, fashion_mnist_dir):
    raw = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    cfg = flatten_dict(raw)
    cfg.update({"data-dir": str(fashion_mnist_dir), "num-records": 1200, "num-server-rounds": 2,
                "jdp.num-rounds": 2, "jdp.results-dir": str(tmp_path / "run"),
                "jdp.noise-seed": 1})  # reproducible: the owners' noise and sampling are seeded
    return cfg


def _start(example, run_config, nodes=3, initial=None, **start_kwargs):
    client_app, task = example
    torch.manual_seed(0)  # the app's own loaders shuffle with torch's global generator
    grid = InProcessGrid(client_app.app, nodes, run_config)
    strategy = JointDP.from_run_config(run_config, node_settle_s=0.0)
    initial = initial if initial is not None else ArrayRecord(task.Net().state_dict())
    kwargs = {"num_rounds": run_config["num-server-rounds"],
              "train_config": ConfigRecord({"lr": run_config["learning-rate"]})}
    kwargs.update(start_kwargs)
    result = strategy.start(grid=grid, initial_arrays=initial, **kwargs)
    return strategy, grid, result


def test_the_users_app_trains_under_joint_dp_and_no_personal_value_leaves(example, run_config):
    strategy, grid, result = _start(example, run_config)
    ledger_eps = strategy.ledger.epsilon()
    assert 0 < ledger_eps <= 8.0
    assert len(strategy.ledger.rounds) == 2
    assert result.evaluate_metrics_clientapp[2]["owners"] == 3
    # 10 classes: chance is 0.1 (std ~0.011 over the owners' 720 test records); 2 rounds at epsilon 8
    # reach 0.19-0.23 over noise seeds 1-4
    assert result.evaluate_metrics_clientapp[2]["eval_acc"] > 0.15
    personal_names = {"fc3.weight", "fc3.bias"}
    stored = []
    for ctx in grid.contexts.values():
        rec = ctx.state[f"personal.{ctx.node_config['partition-id']}"]
        assert set(rec.keys()) == personal_names
        stored += [a.ravel() for a in rec.to_numpy_ndarrays()]
    sent = []
    for reply in grid.sent:
        assert reply.has_content(), reply.error.reason
        for key, record in reply.content.items():
            if isinstance(record, ArrayRecord):
                assert key == "arrays"
                assert not personal_names & set(record.keys())
                sent += [a.ravel() for a in record.to_numpy_ndarrays()]
    for value in stored:  # no personal value hides in anything sent, whole or as a run
        assert not any(_contains(arr, value[:8]) for arr in sent)
    recorded = load_results(run_config["jdp.results-dir"])["config"]  # only what the run used
    assert recorded["personal-layers"] == "^fc3\\." and recorded["target-epsilon"] == 8.0
    assert not {"dataset", "model", "data-dir", "learning-rate", "personal-learning-rate"} & set(recorded)


def test_evaluate_fn_train_config_and_the_round_horizon_are_honoured(example, run_config):
    seen = []

    _, task = example
    initial = ArrayRecord(task.Net().state_dict())

    def evaluate_fn(rnd, arrays):
        net = task.Net()
        net.load_state_dict(arrays.to_torch_state_dict())  # the user's strict load works
        seen.append((rnd, {k: v.numpy() for k, v in arrays.items()}))
        return None

    _start(example, run_config, initial=initial, evaluate_fn=evaluate_fn)
    assert [r for r, _ in seen] == [0, 1, 2]
    for _, arrays in seen:  # personal layers: the public initial values, never an owner's
        np.testing.assert_array_equal(arrays["fc3.weight"], initial["fc3.weight"].numpy())
    assert not np.array_equal(seen[2][1]["conv1.weight"], initial["conv1.weight"].numpy())
    # owners agreed to 2 rounds (local noise); the message names the key as the app spells it
    with pytest.raises(ConfigError, match=r"run-config key 'jdp.num-rounds'=2.*set jdp.num-rounds = 3"):
        _start(example, run_config, num_rounds=3)


def test_initial_arrays_that_do_not_match_fail_before_any_spending(example, run_config):
    _, task = example
    net = task.Net()
    wrong = {k: v for k, v in net.state_dict().items()}
    wrong["conv2.weight"] = torch.zeros(16, 6, 3, 3)
    with pytest.raises(ConfigError, match="conv2.weight"):
        _start(example, run_config, initial=ArrayRecord(wrong))
    extra = dict(net.state_dict())
    extra["bn.running_mean"] = torch.zeros(6)
    with pytest.raises(ConfigError, match="BatchNorm"):
        _start(example, run_config, initial=ArrayRecord(extra))
    assert not (Path(run_config["jdp.results-dir"]) / "ledger.json").exists()


@pytest.mark.parametrize("rule,match", [("^nothing\\.", "matches no parameter"), (".", "matches every parameter")])
def test_personal_layers_matching_nothing_or_everything_fail_at_start(example, run_config, rule, match):
    run_config["jdp.personal-layers"] = rule
    with pytest.raises(ConfigError, match=match):
        _start(example, run_config)


def test_initial_arrays_of_another_model_are_named_before_the_rule(example, run_config):
    """initial_arrays that the personal-layers rule matches none of: if they are not the
    ClientApp's model (another model; the shared layers only) that is the error named,
    with the arrays that differ; if they are, the rule is named, with the names."""
    _, task = example
    other = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    with pytest.raises(ConfigError, match=r"initial_arrays has \['0.bias', '0.weight'.*does not have"):
        _start(example, run_config, initial=ArrayRecord(other.state_dict()))
    shared_only = {k: v for k, v in task.Net().state_dict().items() if not k.startswith("fc3.")}
    with pytest.raises(ConfigError, match=r"initial_arrays lacks \['fc3.bias', 'fc3.weight'\]"):
        _start(example, run_config, initial=ArrayRecord(shared_only))
    run_config["jdp.personal-layers"] = "^head\\."
    with pytest.raises(ConfigError, match=r"'jdp.personal-layers'.*no parameter of initial_arrays.*'fc3.weight'"):
        _start(example, run_config)
    assert not (Path(run_config["jdp.results-dir"]) / "ledger.json").exists()


def test_a_drop_in_app_must_name_its_personal_layers():
    with pytest.raises(ConfigError, match=r"'personal-layers' is set outside the \[tool.flwr.app.config.jdp\]"):
        namespaced_config({"personal-layers": "^fc3\\.", "jdp.target-epsilon": 4.0})
    with pytest.raises(ConfigError, match=r"'jdp.personal-layers' is not set"):
        JointDP(target_epsilon=4.0)
    assert JointDP(personal_layers="^fc3\\.").cfg.personal_layers == "^fc3\\."
    assert namespaced_config({"jdp.method": "fedavg"}).method == "fedavg"  # shares everything


def test_a_privacy_setting_outside_the_jdp_table_is_refused_not_ignored():
    """target-epsilon = 2 written in the app's own table would leave the default 8 in
    force without a word: refused, naming the key and the table it belongs in."""
    with pytest.raises(ConfigError, match=r"'clipping-norm' is set outside .*reads 'jdp.clipping-norm'.*"
                                          r"also 'target-epsilon'"):
        namespaced_config({"target-epsilon": 2.0, "clipping-norm": 0.5, "jdp.personal-layers": "^fc3\\."})
    both = namespaced_config({"target-epsilon": 2.0, "jdp.target-epsilon": 2.0, "jdp.personal-layers": "^fc3\\."})
    assert both.target_epsilon == 2.0  # the app's own key of that name, with flwr-jdp's value: fine
    with pytest.raises(ConfigError, match=r"'target-epsilon'=2.0 and 'jdp.target-epsilon'=8.0 differ"):
        namespaced_config({"target-epsilon": 2.0, "jdp.target-epsilon": 8.0, "jdp.personal-layers": "^fc3\\."})
    assert namespaced_config({"learning-rate": 9.0, "local-epochs": 4,  # the app's own keys
                              "jdp.personal-layers": "^fc3\\."}).local_epochs == 1


def test_model_fn_gets_the_context_only_when_it_needs_an_argument():
    class Net(nn.Module):
        def __init__(self, hidden: int = 4) -> None:
            super().__init__()
            self.fc = nn.Linear(hidden, 2)

    app = ClientApp()
    client = JointDPClient(app, model_fn=Net, train_data=lambda ctx: None)
    ctx = Context(run_id=1, node_id=1, node_config={}, state=None, run_config={"hidden": 3})  # type: ignore[arg-type]
    assert client._model(ctx).fc.in_features == 4
    client.model_fn = lambda context: Net(context.run_config["hidden"])
    assert client._model(ctx).fc.in_features == 3


def test_an_accuracy_metric_under_another_name_is_warned_about(caplog):
    strategy = JointDP(num_rounds=1, personal_layers="^fc\\.")
    strategy._requested = {7: [0]}
    InProcessGrid(None, 0, {})  # the task identity Messages are stamped with
    instruction = Message(RecordDict(), dst_node_id=7, message_type=MessageType.EVALUATE)
    reply = Message(RecordDict({"metrics": MetricRecord({"top1": 0.5, "num-examples": 10})}), reply_to=instruction)
    flwr_logger = logging.getLogger("flwr")
    flwr_logger.addHandler(caplog.handler)
    try:
        metrics = strategy.aggregate_evaluate(1, [reply])
        strategy.aggregate_evaluate(2, [reply])
    finally:
        flwr_logger.removeHandler(caplog.handler)
    assert metrics["top1"] == 0.5 and "accuracy" not in metrics
    warned = [r for r in caplog.records if "none named 'accuracy'" in r.getMessage()]
    assert len(warned) == 1 and "top1" in warned[0].getMessage()  # once per run


def test_namespaced_keys_are_checked_and_named():
    with pytest.raises(ConfigError, match="jdp.target-epsilon"):
        namespaced_config({"jdp.target-epsilon": -1.0})
    with pytest.raises(ConfigError, match="unknown run-config key 'jdp.epsilon' .did you mean 'jdp.target-epsilon'"):
        namespaced_config({"jdp.epsilon": 1.0})
    with pytest.raises(ConfigError, match="'jdp.dataset' is a setting of flwr-jdp's own app"):
        namespaced_config({"jdp.dataset": "fashion-mnist"})  # the user's code loads its own data
    with pytest.raises(ConfigError, match="unknown flwr-jdp setting 'model'"):
        JointDP(model="seed-cnn")
    cfg = namespaced_config({"learning-rate": 5.0, "jdp.batch-size": 7,  # the app's own keys are ignored
                             "jdp.personal-layers": "^fc3\\."})
    assert cfg.batch_size == 7 and cfg.learning_rate == 0.1
    assert JointDP(target_epsilon=2.0, personal_layers="^fc3\\.").cfg.target_epsilon == 2.0


# ------------------------------------------------------------ the client half alone
class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


def _loader(n=40):
    g = torch.Generator().manual_seed(0)
    return DataLoader(TensorDataset(torch.randn(n, 4, generator=g), torch.randint(0, 2, (n,), generator=g)),
                      batch_size=8)


def _sgd_train(lr=0.1, steps_per_batch=1):
    def fn(net, loader):
        opt = torch.optim.SGD(net.parameters(), lr=lr)
        for x, y in loader:
            for _ in range(steps_per_batch):
                opt.zero_grad()
                nn.functional.cross_entropy(net(x), y).backward()
                opt.step()
    return fn


def _client_node(run_config, loader=None, model_fn=None):
    app = ClientApp()
    loader = loader if loader is not None else _loader()
    jdp = JointDPClient(app, model_fn=model_fn or Tiny, train_data=lambda ctx: loader)
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 1},
                  state=RecordDict(), run_config=run_config)
    return app, jdp, ctx, loader


def _setup_and_instruction(app, ctx, z, q, steps, rnd=1, model_fn=None, personal="head."):
    InProcessGrid(app, 1, ctx.run_config)  # stamps message identities
    net = (model_fn or Tiny)()
    public = {n: p.detach().numpy().copy() for n, p in net.named_parameters() if n.startswith(personal)}
    query = Message(RecordDict({protocol.CONFIG: ConfigRecord(),
                                protocol.PUBLIC_PERSONAL: protocol.to_record(public)}),
                    dst_node_id=7, message_type=MessageType.QUERY)
    setup = app(query, ctx)
    assert setup.has_content(), setup.error.reason
    shared = {n: p.detach().numpy().copy() for n, p in net.named_parameters() if not n.startswith(personal)}
    cfg = ConfigRecord({protocol.ROUND: rnd, protocol.OWNERS: [0], protocol.SAMPLE_RATES: [q],
                        protocol.STEPS: [steps], protocol.NOISE_MULTIPLIER: z, protocol.SESSION: "s1"})
    train = Message(RecordDict({protocol.SHARED: protocol.to_record(shared), protocol.CONFIG: cfg}),
                    dst_node_id=7, message_type=MessageType.TRAIN)
    return setup, shared, train


RC = {"jdp.personal-layers": "^head\\.", "jdp.batch-size": 8, "jdp.local-epochs": 1, "jdp.num-rounds": 2,
      "jdp.target-epsilon": 50.0}


def test_setup_reports_size_and_model_and_an_empty_loader_is_named():
    app, _, ctx, _ = _client_node(dict(RC))
    setup, _, _ = _setup_and_instruction(app, ctx, 1.0, 0.2, 5)
    rec = setup.content[protocol.SETUP]
    assert list(rec[protocol.NUM_RECORDS]) == [40] and "body.weight" in list(rec[protocol.PARAM_NAMES])
    empty = DataLoader(TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long)))
    app, _, ctx, _ = _client_node(dict(RC), loader=empty)
    query = Message(RecordDict({protocol.CONFIG: ConfigRecord()}), dst_node_id=7, message_type=MessageType.QUERY)
    reply = app(query, ctx)
    assert reply.has_error() and "training data set is empty" in reply.error.reason


def test_an_instruction_with_less_noise_than_agreed_is_refused_by_the_owner():
    app, jdp, ctx, loader = _client_node(dict(RC))
    _, _, train = _setup_and_instruction(app, ctx, 0.0, 0.2, 5)
    reply = jdp.train(train, ctx, Tiny(), loader, _sgd_train())
    assert reply.has_error() and reply.error.reason.startswith("refused:")


def test_two_steps_per_batch_and_a_non_finite_loss_are_named():
    app, jdp, ctx, loader = _client_node(dict(RC))
    _, _, train = _setup_and_instruction(app, ctx, 2.0, 0.2, 5)
    reply = jdp.train(train, ctx, Tiny(), loader, _sgd_train(steps_per_batch=2))
    assert reply.has_content()  # the second step of each batch is set aside: one DP step per batch
    app, jdp, ctx, loader = _client_node(dict(RC))
    _, _, train = _setup_and_instruction(app, ctx, 2.0, 0.2, 5)
    reply = jdp.train(train, ctx, Tiny(), loader, _sgd_train(lr=float("nan")))
    assert reply.has_error() and "non-finite" in reply.error.reason


def test_reply_holds_only_shared_arrays_and_the_release_takes_the_scheduled_steps():
    app, jdp, ctx, loader = _client_node(dict(RC))
    _, shared, train = _setup_and_instruction(app, ctx, 2.0, 0.2, 5)
    calls = []

    def fn(net, loader_):
        if not isinstance(loader_.dataset, _SyntheticSet):  # the dry run on synthetic records
            calls.append(len(loader_))
        _sgd_train()(net, loader_)

    reply = jdp.train(train, ctx, Tiny(), loader, fn)
    assert reply.has_content(), reply.error.reason
    assert set(reply.content.keys()) == {"arrays", "metrics"}
    assert set(reply.content["arrays"].keys()) == set(shared)
    assert calls == [5, 5]  # personal fit on the user's loader (5 batches), then 5 DP steps
    assert int(reply.content["metrics"][protocol.NUM_EXAMPLES]) == 40


def test_noise_the_users_optimizer_applies_has_the_ledgers_std():
    """The same loop, data and seed with z and with z = 0 (the generator draws the
    same batches and noise directions), plain SGD at lr 1: the releases differ by the
    summed noise, -N(0, steps (z C)^2) / (q N) per shared parameter; the ledger's
    event is PoissonSampled(q, Gaussian(z)) with sensitivity C."""
    z, clip, q, n, steps = 1.5, 1.0, 0.25, 40, 4

    def release(noise):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(4, 200), nn.Linear(200, 2))
        for p in net[1].parameters():
            p.requires_grad_(False)
        with private_training(net, _loader(n), unit_of_record=torch.arange(n), num_units=n, sample_rate=q,
                              steps=steps, noise_multiplier=noise, clipping_norm=clip,
                              generator=torch.Generator().manual_seed(3)) as (model, loader, record):
            _sgd_train(lr=1.0)(model, loader)
        assert record.steps_taken == steps
        return torch.cat([record.release[k].ravel() for k in ("0.weight", "0.bias")])

    moved = (release(z) - release(0.0)).numpy()
    expected = z * clip / (q * n) * np.sqrt(steps)
    assert abs(moved.std() / expected - 1) < 0.1  # 1,000 values: std error ~2%; a 2x cut fails


def test_one_record_moves_the_release_by_at_most_lr_c_over_the_expected_batch():
    """z = 0, q = 1, one step: removing one record moves the shared parameters by
    at most lr * C / (q N) (the sensitivity through the user's own loop)."""
    n, clip, lr = 40, 0.5, 0.3
    loader = _loader(n)
    x, y = loader.dataset.tensors

    def release(xs, ys):
        torch.manual_seed(0)
        net = Tiny()
        for p in net.head.parameters():
            p.requires_grad_(False)
        with private_training(net, DataLoader(TensorDataset(xs, ys), batch_size=8),
                              unit_of_record=torch.arange(len(ys)), num_units=n, sample_rate=1.0, steps=1,
                              noise_multiplier=0.0, clipping_norm=clip,
                              generator=torch.Generator().manual_seed(0)) as (model, pl, _):
            _sgd_train(lr=lr)(model, pl)
        return torch.cat([p.detach().ravel() for p in net.body.parameters()])

    full = release(x, y)
    moves = [float((full - release(torch.cat([x[:i], x[i + 1:]]), torch.cat([y[:i], y[i + 1:]]))).norm())
             for i in range(5)]
    assert max(moves) <= lr * clip / n * (1 + 1e-4)
    assert max(moves) > 0.5 * lr * clip / n  # some record's gradient is clipped to C


def test_owner_unit_local_release_is_a_clipped_noised_update():
    rc = dict(RC, **{"jdp.privacy-unit": "owner"})
    app, jdp, ctx, loader = _client_node(rc)
    _, shared, train = _setup_and_instruction(app, ctx, 3.0, 1.0, 1)
    reply = jdp.train(train, ctx, Tiny(), loader, _sgd_train())
    assert reply.has_content(), reply.error.reason
    delta = np.concatenate([a.ravel() for a in reply.content["arrays"].to_numpy_ndarrays()])
    assert delta.std() > 1.0  # N(0, 3^2) noise on an update clipped to 1



def test_user_unit_reports_users_and_samples_whole_users():
    """jdp.privacy-unit = "user": the set-up reports the number of users and every
    Poisson batch holds all records of each sampled user or none of them."""
    rc = dict(RC, **{"jdp.privacy-unit": "user", "jdp.records-per-user": 4})
    users = [i // 4 for i in range(40)]  # 10 users of 4 records
    app = ClientApp()
    loader = _loader()
    jdp = JointDPClient(app, model_fn=Tiny, train_data=lambda ctx: loader, user_ids=lambda ctx: users)
    ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0, "num-partitions": 1},
                  state=RecordDict(), run_config=rc)
    setup, _, train = _setup_and_instruction(app, ctx, 2.0, 0.2, 5)
    assert list(setup.content[protocol.SETUP][protocol.NUM_USERS]) == [10]
    batches = []

    def fn(net, loader_):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        for x, y in loader_:
            if not isinstance(loader_.dataset, _SyntheticSet):
                batches.append(len(y))
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()

    reply = jdp.train(train, ctx, Tiny(), loader, fn)
    assert reply.has_content(), reply.error.reason
    assert all(n % 4 == 0 for n in batches[5:])  # the private batches: whole users only


def test_a_clientapp_without_the_client_half_is_named_at_set_up(example, run_config):
    """Only the ServerApp converted: the nodes cannot answer the set-up; the error says
    what to add, before any privacy is spent."""
    _, task = example
    plain = ClientApp()

    @plain.train()
    def train(msg, context):  # noqa: ANN001, ANN202 - the app's unconverted handler
        raise AssertionError("never reached")

    grid = InProcessGrid(plain, 2, run_config, errors_as_replies=True)  # as a SuperNode answers
    strategy = JointDP.from_run_config(run_config, node_settle_s=0.0)
    with pytest.raises(RuntimeError, match=r"failed at set-up: .*create JointDPClient\(app"):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(task.Net().state_dict()), num_rounds=2)
    assert not (Path(run_config["jdp.results-dir"]) / "ledger.json").exists()


def test_the_users_model_class_loads_the_result_arrays(example, run_config, caplog):
    """The unchanged quickstart saves ``result.arrays`` and reloads it into ``Net()``:
    the shared layers as trained, the personal ones at their public initial values
    (one log line says so)."""
    _, task = example
    initial = task.Net()
    with caplog.at_level(logging.INFO, logger="flwr"):
        _, _, result = _start(example, run_config, initial=ArrayRecord(initial.state_dict()))
    net = task.Net()
    net.load_state_dict(result.arrays.to_torch_state_dict())  # no missing or unexpected key
    assert torch.equal(net.fc3.weight, initial.fc3.weight)
    assert not torch.equal(net.fc1.weight, initial.fc1.weight)
    assert any("public initial values" in r.getMessage() for r in caplog.records)


def test_rounds_epochs_and_batch_size_can_be_read_from_the_apps_own_keys():
    """The jdp table may name the app's own key instead of repeating its value; a name
    that is no key of the run config fails at start-up, naming both."""
    rc = {"num-server-rounds": 4, "local-epochs": 2, "batch-size": 16, "jdp.personal-layers": "^fc3\\.",
          "jdp.num-rounds": "num-server-rounds", "jdp.local-epochs": "local-epochs", "jdp.batch-size": "batch-size"}
    cfg = namespaced_config(rc)
    assert (cfg.num_rounds, cfg.local_epochs, cfg.batch_size) == (4, 2, 16)
    with pytest.raises(ConfigError, match=r"'jdp.num-rounds' = 'rounds' names no key of your app's run config"):
        namespaced_config(dict(rc, **{"jdp.num-rounds": "rounds"}))
