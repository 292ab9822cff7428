"""The engine tests run on the same tiny checkpoints as the model tests."""

from tests.actors.conftest import tiny_llama, tiny_qwen2  # noqa: F401
