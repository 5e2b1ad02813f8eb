"""`chunkserve generate` as a user runs it."""

from __future__ import annotations

import pytest

from chunkserve.entrypoints.cli import main


def test_generate_prints_a_sensible_answer(capsys):
    main(["generate", "What is the capital of France?", "--max-tokens", "16", "--kv-cache-memory-gb", "0.1"])
    assert "Paris" in capsys.readouterr().out


def test_generate_with_a_missing_model_is_a_clear_error(capsys, tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--model", str(missing)])
    assert exit_info.value.code == 2
    assert str(missing) in capsys.readouterr().err


def test_bad_sampling_flag_is_a_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "hi", "--top-p", "0", "--kv-cache-memory-gb", "0.1"])
    assert exit_info.value.code == 2
    assert "top_p must be in (0, 1]" in capsys.readouterr().err
