"""`gdnserve generate` runs the embedded model end to end on the CPU, deterministically."""
from gdnserve.cli import main


def test_generate_embedded_model(capsys):
    assert main(["generate", "Hello", "--max-tokens", "5", "--device", "cpu"]) == 0
    first = capsys.readouterr()
    assert "5 generated tokens" in first.err
    assert main(["generate", "Hello", "--max-tokens", "5", "--device", "cpu"]) == 0
    assert capsys.readouterr().out == first.out          # fixed-seed weights, greedy


def test_generate_rejects_bad_arguments(capsys):
    assert main(["generate", "x", "--max-tokens", "0", "--device", "cpu"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
