"""The invariant table in tests/README.md is what the tests' markers say (tests/invariants.py)."""

from __future__ import annotations

import pytest

import invariants


def test_every_invariant_has_a_test_and_the_readme_table_is_the_markers():
    assert invariants.problems(invariants.README.read_text()) == []


def test_the_table_is_read_from_function_class_and_module_markers(tmp_path):
    (tmp_path / "test_a.py").write_text(
        "import pytest\n"
        "pytestmark = [pytest.mark.usefixtures('x'), pytest.mark.invariant(9)]\n"
        "@pytest.mark.parametrize('v', [1])\n@pytest.mark.invariant(2, 3)\ndef test_one(v): pass\n"
        "def test_two(): pass\n"
        "class TestThree:\n    @pytest.mark.invariant(4)\n    def test_four(self): pass\n"
        "@pytest.mark.invariant(5)\ndef helper(): pass\n"
    )
    marks = invariants.marked(tmp_path)
    assert marks == {
        2: ["test_a.py::test_one"],
        3: ["test_a.py::test_one"],
        4: ["test_a.py::test_four"],
        9: ["test_a.py::test_four", "test_a.py::test_one", "test_a.py::test_two"],
    }
    table = invariants.table(marks)
    assert "| 4 | " in table and "`test_a.py`: `test_four` |" in table and "| 1 | " in table and "**none**" in table
    readme = f"intro\n{invariants.generated_block(marks)}\nrest\n"
    assert invariants.problems(readme, marks) == [
        f"invariant {n} ({invariants.INVARIANTS[n].split(':')[0]}) has no test marked @pytest.mark.invariant({n})"
        for n in invariants.INVARIANTS
        if n not in marks
    ]
    edited = readme.replace("`test_four`", "`test_five`")
    assert invariants.problems(edited, marks)[-1].startswith(
        "the invariant table in README.md is not the tests' markers"
    )
    (tmp_path / "test_b.py").write_text("import pytest\n@pytest.mark.invariant(17)\ndef test_x(): pass\n")
    with pytest.raises(ValueError, match="test_b.py::test_x: there is no invariant 17"):
        invariants.marked(tmp_path)
