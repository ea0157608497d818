"""The Flower ServerApp and ClientApp handlers, in this process (no network): a federation on
SuperNode clients reaches the same per-client Z as the in-process engine, clients never send an
update, a silent node is a dropout, bad settings are one clear line."""

import json

import pytest

pytestmark = pytest.mark.flower

flwr = pytest.importorskip(
    "flwr", reason="the Flower extra is not installed (pip install '.[flower]')"
)

from flwr.app import Context, Error, Message, RecordDict  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402
from flwr.supercore.task_identity import TaskIdentity  # noqa: E402

from conftest import small_overrides as _small  # noqa: E402
from fedattr.config import load, to_dict  # noqa: E402
from fedattr.errors import UserError  # noqa: E402
from fedattr.flower.client_app import app as client_app  # noqa: E402
from fedattr.flower.server_app import serve  # noqa: E402
from fedattr.pipeline.config import DemoConfig, RunConfig  # noqa: E402
from fedattr.pipeline.run import run_demo, run_experiment  # noqa: E402
from fedattr.reporting.run_folder import RunFolder  # noqa: E402
from fedattr.secagg import QueryRefused  # noqa: E402


class LocalGrid(Grid):
    """SuperNodes in this process: each message goes through the ClientApp with the node's
    own context, as a SuperNode would run it; ``silent`` maps a message type to nodes that
    never answer it (past the timeout)."""

    def __init__(self, partitions, node_config=None):
        self.contexts = {
            100 + p: Context(
                1, 100 + p, {"partition-id": p, **(node_config or {})}, RecordDict(), {}
            )
            for p in partitions
        }
        self.silent: dict[str, set[int]] = {}
        self.sent: list[Message] = []
        self.inbox: dict[str, Message] = {}

    def set_run(self, run):
        pass

    @property
    def run(self):
        raise NotImplementedError

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, group_id=group_id)

    def get_node_ids(self):
        return list(self.contexts)

    def push_messages(self, messages):
        ids = []
        for m in messages:
            self.sent.append(m)
            m.metadata.__dict__["_message_id"] = mid = f"m{len(self.sent)}"
            ids.append(mid)
            node = m.metadata.dst_node_id
            if node in self.silent.get(m.metadata.message_type, set()):
                continue
            try:
                reply = client_app(m, self.contexts[node])
            except Exception as exc:  # a SuperNode turns a ClientApp exception into an error reply
                reply = Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"), reply_to=m)
            self.inbox[mid] = reply
        return ids

    def pull_messages(self, message_ids):
        return [self.inbox.pop(i) for i in message_ids if i in self.inbox]

    def send_and_receive(self, messages, *, timeout=None):
        raise NotImplementedError  # fedattr pushes and pulls itself


def killed_in_round_2(grid):
    """``grid`` whose ServerApp is killed as it sends round 2's ``train`` messages."""

    class Killed(grid):
        def push_messages(self, messages):
            if any(
                m.metadata.message_type == "train" and m.metadata.group_id == "2" for m in messages
            ):
                raise KeyboardInterrupt  # the ServerApp is killed during round 2
            return super().push_messages(messages)

    return Killed


@pytest.fixture(autouse=True)
def _task_identity():
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def _claimed(tmp_path, cfg):
    folder = RunFolder(tmp_path / "flower")
    folder.claim(to_dict(cfg))
    return folder


def _z(result):
    return {c.id: (c.z, c.Z, c.p, c.flagged) for c in result.report.clients}


def _demo(queries="subsets", **synthetic):
    return load(
        DemoConfig,
        None,
        [
            *(f"synthetic.{k}={v}" for k, v in synthetic.items()),
            "attribution.protocol.N=2",
            "attribution.protocol.M=2",
            "secagg.min_members=2",
            f"attribution.protocol.queries={queries}",
        ],
    )


@pytest.mark.parametrize("queries", ["subsets", "fused"])
def test_synthetic_federation_on_supernodes_equals_the_in_process_run(tmp_path, queries):
    cfg = _demo(queries, K=5, rounds=2, dim=64, r=2)
    grid = LocalGrid(range(5))
    folder = _claimed(tmp_path, cfg)
    remote = serve(
        grid,
        {"run-folder": str(folder.path), "command": "demo", "timeout": 30},
        say=lambda _m: None,
    )
    local = run_demo(cfg)
    assert _z(remote) == _z(local)
    assert remote.report.flagged == local.report.flagged
    # same answered queries (ids, members, coefficients) as the in-process backend
    strip = ("seconds", "client_seconds_max", "bytes_moved")
    assert [{k: v for k, v in q.items() if k not in strip} for q in remote.queries] == [
        {k: v for k, v in q.items() if k not in strip} for q in local.queries
    ]
    # per round: the aggregate, then 2M subset sums or one fused combination per target
    per_target = 1 if queries == "fused" else 2 * cfg.attribution.protocol.M
    assert len(local.queries) == cfg.synthetic.rounds * (1 + per_target * cfg.synthetic.K)
    # no message from a client carried an update: only keys, layouts, masked vectors
    kinds = {m.metadata.message_type for m in grid.sent}
    assert kinds == {"query.register", "train", "query.sa_batch"}
    runtime = json.loads((folder.path / "results.json").read_text())["runtime"]
    assert runtime["name"] == "flower" and runtime["nodes"] == {str(c): 100 + c for c in range(5)}
    # one SA exchange for the aggregate, one for the attribution batch, per round
    assert runtime["sa_exchanges"] == 2 * cfg.synthetic.rounds


def test_a_node_that_stops_answering_is_a_dropout_and_the_run_goes_on(tmp_path):
    cfg = _demo(K=6, rounds=1, dim=32, r=1)
    grid = LocalGrid(range(6))
    grid.silent["query.sa_batch"] = {104}
    folder = _claimed(tmp_path, cfg)
    result = serve(
        grid,
        {"run-folder": str(folder.path), "command": "demo", "timeout": 0.5},
        say=lambda _m: None,
    )
    (record,) = result.rounds
    assert 4 in record["dropouts"]
    # the round's aggregate was released without client 4, never with it
    assert all(4 not in q["subset"] for q in result.queries)


def test_a_clients_own_threshold_refuses_what_the_server_asks(tmp_path):
    cfg = _demo(K=5, rounds=1, dim=16, r=1)
    grid = LocalGrid(range(5), node_config={"min-members": 5})
    folder = _claimed(tmp_path, cfg)
    # N=2 needs subsets of 2 and 3 clients; nodes that admit only 5 refuse them, and a
    # paper-mode run stops there with the reason
    with pytest.raises(QueryRefused, match="below this client's threshold min_members=5"):
        serve(
            grid,
            {"run-folder": str(folder.path), "command": "demo", "timeout": 0.5},
            say=lambda _m: None,
        )
    assert not (folder.path / "results.json").exists()


def test_bad_settings_are_one_clear_line(tmp_path):
    cfg = _demo(K=5, rounds=1, dim=16)
    folder = _claimed(tmp_path, cfg)
    with pytest.raises(UserError, match=r"fl\.K: the run has 5 clients but 3 SuperNodes"):
        serve(
            LocalGrid(range(3)),
            {"run-folder": str(folder.path), "command": "demo", "timeout": 5, "wait-nodes": 0.1},
        )
    with pytest.raises(UserError, match=r"register: UserError: partition-id: must be in 0\.\.4"):
        serve(
            LocalGrid([0, 1, 2, 3, 7]),
            {"run-folder": str(folder.path), "command": "demo", "timeout": 5},
        )
    with pytest.raises(UserError, match="command: unknown 'train'; allowed: run, demo"):
        serve(LocalGrid(range(5)), {"run-folder": str(folder.path), "command": "train"})
    plain = _demo(K=5, rounds=1, dim=16)
    plain.secagg.backend = "plaintext"
    other = _claimed(tmp_path / "b", plain)
    with pytest.raises(UserError, match=r"secagg\.backend: .* allowed: pairwise-mask"):
        serve(LocalGrid(range(5)), {"run-folder": str(other.path), "command": "demo"})


def test_tiny_llm_federation_on_supernodes_equals_the_in_process_run(tiny_cache, tmp_path):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the nodes train with one thread each; so does the reference
    try:
        # Flower's clients train one after another: so does the in-process reference.
        cfg = load(RunConfig, None, _small(tiny_cache, "fl.rounds=1", "fl.batched=false"))
        grid = LocalGrid(range(cfg.fl.K))
        folder = _claimed(tmp_path, cfg)
        import os

        os.environ["FEDATTR_THREADS"] = "1"
        remote = serve(grid, {"run-folder": str(folder.path), "timeout": 60}, say=lambda _m: None)
        local = run_experiment(cfg)
    finally:
        os.environ.pop("FEDATTR_THREADS", None)
        torch.set_num_threads(threads)
    assert _z(remote) == _z(local)
    assert remote.rounds[0]["train_loss"] == local.rounds[0]["train_loss"]
    assert (folder.path / "report.md").is_file()


def test_an_interrupted_flower_run_resumes_to_the_same_results(tiny_cache, tmp_path):
    cfg = load(RunConfig, None, _small(tiny_cache))
    first = _claimed(tmp_path / "a", cfg)
    whole = serve(LocalGrid(range(cfg.fl.K)), {"run-folder": str(first.path)}, say=lambda _m: None)

    Killed = killed_in_round_2(LocalGrid)
    folder = _claimed(tmp_path / "b", cfg)
    with pytest.raises(KeyboardInterrupt):
        serve(Killed(range(cfg.fl.K)), {"run-folder": str(folder.path)}, say=lambda _m: None)
    assert folder.status == "interrupted"
    said = []
    again = serve(LocalGrid(range(cfg.fl.K)), {"run-folder": str(folder.path)}, say=said.append)
    assert "resuming after round 1 of 2" in said
    assert _z(again) == _z(whole)
    assert folder.status == "finished" and not folder.checkpoint_path.exists()
