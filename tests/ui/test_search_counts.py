"""What a layout search did, in words (ui.tables.search_counts), as the planner and meshes pages say it."""

from types import SimpleNamespace

from ui.tables import search_counts


def _report(considered: int, evaluated: int) -> SimpleNamespace:
    return SimpleNamespace(considered=considered, evaluated=evaluated, elapsed_s=1.234)


def test_the_layouts_that_divide_are_not_said_to_be_simulated():
    """DeepSeek-V3 on 2,048 H800 had read "8,181 layouts considered (1,075 simulations of them and their ZeRO and
    recomputation variants)", as if each had been simulated with its variants."""
    words = search_counts(_report(8181, 1075))
    assert words == ("8,181 layouts divide the model and the batch, searched in 1.23 s: 1,075 simulations of them "
                     "and their ZeRO and recomputation variants; any others were ruled out unsimulated, by memory or "
                     "by a bound on their step time")
    assert "considered" not in words


def test_a_search_that_simulated_nothing_says_so():
    """Llama 3 405B on one chip: "7 layouts considered (0 simulations ...)"."""
    assert search_counts(_report(7, 0)) == ("7 layouts divide the model and the batch, searched in 1.23 s: none fits "
                                            "in memory, so none was simulated")
    assert search_counts(_report(1, 0)).startswith("1 layout divides the model")
