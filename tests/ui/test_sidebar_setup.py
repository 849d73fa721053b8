"""The sidebar's setup says honestly where it applies: the lessons read it, the Lab does not."""

from tests.ui.apptest_util import open_app


def test_the_lab_says_it_does_not_use_the_sidebars_setup():
    """The sidebar's model, chip and mesh sat beside the Lab, which never reads them."""
    lab = open_app("app_pages/lab.py")
    assert not lab.exception
    assert any("The Lab does not use this setup" in c.value for c in lab.sidebar.caption)
    lesson = open_app("app_pages/data_parallel.py")
    assert not lesson.exception
    said = " ".join(c.value for c in lesson.sidebar.caption)
    assert "Shared by the lessons" in said and "The Lab does not use" not in said


def test_the_home_page_does_not_claim_every_page_reads_the_setup():
    at = open_app()
    text = " ".join(m.value for m in at.markdown)
    assert "Every page reads it" not in text and "the Lab has its own model" in text


def test_one_chip_is_said_once():
    """All degrees 1 had read "1 chip = **1 chip** of H100 SXM"."""
    at = open_app(dp="1")
    said = [c.value for c in at.sidebar.caption if "H100" in c.value]
    assert said == ["**One chip** of H100 SXM, nothing split: raise a degree above to share the work."]
    at = open_app(dp="2", tp="2")
    assert any(c.value.startswith("dp=2 x tp=2 = **4 chips** of H100") for c in at.sidebar.caption)
