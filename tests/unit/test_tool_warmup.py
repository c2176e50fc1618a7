"""The tools demo's warm-up: its early stop once episodes with a tool call are copied exactly."""

from types import SimpleNamespace

import pytest

from tether.demo.tasks import read_jsonl
from tether.demo.tiny_model import build_tiny_model
from tether.demo.tool_task import ToolTask, write_tool_task
from tether.demo.warmup import CHECK_EVERY, episode_exactness, warmup_sft


class EchoModel:
    """A fake of a causal LM, named as one: its greedy choice at each position is the next id
    of its input (it "knows" every episode), except at ``wrong`` positions."""

    def __init__(self, vocab: int, wrong: set[int] = frozenset()) -> None:
        self.vocab, self.wrong, self.training = vocab, wrong, True

    def eval(self) -> None:
        self.training = False

    def train(self, mode: bool = True) -> None:
        self.training = mode

    def __call__(self, *, input_ids, attention_mask):
        import torch

        nxt = torch.roll(input_ids, -1, dims=1)
        for pos in self.wrong:
            nxt[:, pos] = (nxt[:, pos] + 1) % self.vocab
        return SimpleNamespace(logits=torch.nn.functional.one_hot(nxt, self.vocab).float())


def test_episode_exactness_counts_episodes_copied_after_their_first_token():
    # prompt [5, 6], completion [7, 8, 9] with loss on 7 (the decision), 8 and 9; 1 and 2 no loss
    episodes = [([5, 6], [7, 1, 8, 2, 9], [1, 0, 1, 0, 1])] * 3
    assert episode_exactness(EchoModel(16), episodes, pad_id=0) == 1.0
    # the decision token (predicted at position 1) wrong: still exact once it is taken
    assert episode_exactness(EchoModel(16, wrong={1}), episodes, pad_id=0) == 1.0
    # a tool-turn token (the 1, predicted at position 2, no loss) wrong: not counted
    assert episode_exactness(EchoModel(16, wrong={2}), episodes, pad_id=0) == 1.0
    # a copied token (the 8, predicted at position 3) wrong: no episode is exact
    model = EchoModel(16, wrong={3})
    assert episode_exactness(model, episodes, pad_id=0) == 0.0
    assert model.training  # put back as it was


@pytest.mark.parametrize("stop_at_exact, steps_run", [(0.0, 25), (None, 60)])
def test_warmup_stops_at_the_first_check_that_passes(tmp_path, stop_at_exact, steps_run):
    assert CHECK_EVERY == 25
    base = build_tiny_model(tmp_path / "base", hidden_size=32, num_layers=1, tools=True)
    paths = write_tool_task(tmp_path / "data", ToolTask(num_train=60, num_eval=5))
    report = warmup_sft(base, paths["train"], steps=60, lr=3e-3, batch_size=2, seed=0,
                        out_dir=tmp_path / "warm", tools=["calculator"],
                        stop_at_exact=stop_at_exact)  # fmt: skip
    assert report["steps"] == steps_run
    again = warmup_sft(base, paths["train"], steps=60, lr=3e-3, batch_size=2, seed=0,
                       out_dir=tmp_path / "warm", tools=["calculator"],
                       stop_at_exact=stop_at_exact)  # fmt: skip
    assert again["reused"] and again["steps"] == steps_run


def test_two_stage_warmup_stops_the_first_stage_at_its_check_then_runs_the_second(tmp_path):
    base = build_tiny_model(tmp_path / "base", hidden_size=32, num_layers=1, tools=True)
    paths = write_tool_task(tmp_path / "data", ToolTask(num_train=60, num_eval=5))
    careful, sloppy = read_jsonl(paths["careful"]), read_jsonl(paths["train"])
    assert [r["prompt"] for r in careful] == [r["prompt"] for r in sloppy]
    assert all(len(r["turns"]) == 3 for r in careful)  # the calculator on every problem
    kwargs = dict(steps=10, lr=3e-3, batch_size=2, seed=0, out_dir=tmp_path / "warm",
                  tools=["calculator"], first_jsonl=paths["careful"], first_steps=60)  # fmt: skip
    report = warmup_sft(base, paths["train"], stop_at_exact=0.0, **kwargs)
    assert report["first_steps"] == CHECK_EVERY and report["first_exact"] is not None
    assert report["steps"] == CHECK_EVERY + 10
    assert warmup_sft(base, paths["train"], stop_at_exact=0.0, **kwargs)["reused"]
    # without a check the first stage runs all its steps
    kwargs["out_dir"] = tmp_path / "warm2"
    report = warmup_sft(base, paths["train"], stop_at_exact=None, **kwargs)
    assert report["first_steps"] == 60 and report["first_exact"] is None
    assert report["steps"] == 70
