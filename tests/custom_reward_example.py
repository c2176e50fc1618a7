"""A tiny custom reward for tests/services/test_rewards.py, loaded as
``tests.custom_reward_example:brevity_bonus`` (the documented custom-reward signature)."""


def brevity_bonus(*, prompt: str, response: str, ground_truth: str | None, metadata: dict) -> float:
    """0.5 for responses shorter than ``metadata["short_chars"]`` (default 40), else 0."""
    return 0.5 if len(response) < metadata.get("short_chars", 40) else 0.0


def two_parts(*, prompt: str, response: str, ground_truth: str | None, metadata: dict) -> dict:
    return {"has_prompt_echo": float(prompt in response), "constant": 0.25}


def fails_on_marker(*, prompt: str, response: str, ground_truth: str | None, metadata: dict):
    if "FAIL" in response:
        raise RuntimeError("deliberate failure for the test")
    return 1.0


def returns_text(*, prompt: str, response: str, ground_truth: str | None, metadata: dict):
    return "not a number"


def wrong_signature(text):
    return 0.0


NOT_CALLABLE = 3
