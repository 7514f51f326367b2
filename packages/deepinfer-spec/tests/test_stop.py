import pytest

from deepinfer.spec import FINISH_LENGTH, FINISH_STOP, cut_accepted_run


def test_eos_inside_the_run_cuts_after_it() -> None:
    run = cut_accepted_run([5, 2, 7, 8], num_output_tokens=3, max_tokens=100, eos_token_id=2)
    assert (run.token_ids, run.finish_reason, run.stop_token_id) == ((5, 2), FINISH_STOP, 2)


def test_stop_ids_and_ignore_eos() -> None:
    run = cut_accepted_run([5, 2, 7, 8], num_output_tokens=0, max_tokens=100, eos_token_id=2, ignore_eos=True,
                           stop_token_ids=(7,))
    assert (run.token_ids, run.finish_reason) == ((5, 2, 7), FINISH_STOP)


def test_max_tokens_cuts_the_run_exactly() -> None:
    run = cut_accepted_run([5, 6, 7, 8], num_output_tokens=8, max_tokens=10)
    assert (run.token_ids, run.finish_reason) == ((5, 6), FINISH_LENGTH)
    run = cut_accepted_run([5, 6], num_output_tokens=8, max_tokens=10)
    assert (run.token_ids, run.finish_reason) == ((5, 6), FINISH_LENGTH)
    run = cut_accepted_run([5, 6], num_output_tokens=7, max_tokens=10)
    assert (run.token_ids, run.finish_reason) == ((5, 6), None)


def test_min_tokens_defers_stops() -> None:
    run = cut_accepted_run([2, 2, 2], num_output_tokens=0, max_tokens=10, eos_token_id=2, min_tokens=2)
    assert run.token_ids == (2, 2) and run.finish_reason == FINISH_STOP


def test_bad_budget_is_refused() -> None:
    with pytest.raises(ValueError):
        cut_accepted_run([1], num_output_tokens=0, max_tokens=0)
