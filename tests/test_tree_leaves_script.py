"""scripts/tree_leaves.py: a finished leaf's solution is its path's text, its score the node's."""

import importlib.util
import pathlib

spec = importlib.util.spec_from_file_location("tree_leaves", pathlib.Path(__file__).parents[1] / "scripts" / "tree_leaves.py")
assert spec is not None and spec.loader is not None
tree_leaves = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tree_leaves)


def node(i, parent, text, state, score=None):
    return {"id": i, "parent": parent, "text": text, "state": state, "score": score}


def test_leaves_are_the_finished_nodes_with_their_paths_text():
    old = {"kind": "tree", "nodes": [node(0, None, "", "expanded"), node(1, 0, "stale", "finished", 1.0)]}
    tree = {"kind": "tree", "nodes": [
        node(0, None, "", "expanded"), node(1, 0, "2 + 3 = 5\n\n", "expanded", 0.8),
        node(2, 1, "Answer: 5", "finished", 0.9), node(3, 1, "Answer: 6", "finished", 0.2),
        node(4, 0, "2 * 3 = 6\n\n", "pruned", 0.1), node(5, 4, "Answer: 6", "open", 0.3)]}
    # the last tree event is the final tree; open and pruned nodes are not solutions
    assert tree_leaves.leaves([old, {"kind": "expand"}, tree]) == [("2 + 3 = 5\n\nAnswer: 5", 0.9),
                                                                   ("2 + 3 = 5\n\nAnswer: 6", 0.2)]
    assert tree_leaves.leaves([{"kind": "expand"}]) == []
