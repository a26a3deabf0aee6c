"""The tensor tree: keys grouped by their name path, populated lazily as nodes expand.

A 5,000-tensor checkpoint opens fast because only the top level is built at
first; the nested index itself is plain dicts, built in one pass over the keys.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rich.text import Text
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from ckptfmt.format.manifest import TensorEntry
from ckptfmt.tui.widgets.formatting import human_bytes, shape_text, split_key, tensor_count

EXPAND_ALL_BELOW = 200  # a filter matching fewer tensors than this opens every group


@dataclass
class Group:
    """One node of the name path: child groups, the tensor stored at this path (if any) and totals."""

    name: str
    children: dict[str, Group] = field(default_factory=dict)
    tensor: str | None = None
    count: int = 0
    nbytes: int = 0


def build_index(entries: list[TensorEntry]) -> Group:
    """Group tensors by the parts of their keys, counting tensors and bytes under each group."""
    root = Group("")
    for entry in entries:
        node = root
        node.count += 1
        node.nbytes += entry.nbytes
        for part in split_key(entry.key):
            node = node.children.setdefault(part, Group(part))
            node.count += 1
            node.nbytes += entry.nbytes
        node.tensor = entry.key
    return root


class TensorTree(Tree[Group]):
    """A tree of tensor groups; a node's children are added the first time it expands."""

    def __init__(self, **kwargs) -> None:
        super().__init__("tensors", **kwargs)
        self.show_root = False
        self._entries: dict[str, TensorEntry] = {}

    def show(self, entries: list[TensorEntry]) -> None:
        """Replace the tree's content with ``entries``; opens every group when they are few, else the top ones."""
        self._entries = {e.key: e for e in entries}
        self.clear()
        index = build_index(entries)
        self.root.data = index
        self._populate(self.root)
        if len(entries) < EXPAND_ALL_BELOW:
            self._expand_all(self.root)
        else:
            self._expand_single_path(self.root)
        self.root.expand()

    def _expand_single_path(self, node: TreeNode[Group]) -> None:
        """Open groups that are their parent's only child ('model > layers'), where nothing else is to choose."""
        while len(node.children) == 1 and node.children[0].allow_expand:
            node = node.children[0]
            self._populate(node)
            node.expand()

    def _expand_all(self, node: TreeNode[Group]) -> None:
        for child in node.children:
            if child.allow_expand:
                self._populate(child)
                child.expand()
                self._expand_all(child)

    def _populate(self, node: TreeNode[Group]) -> None:
        """Add the children of ``node`` unless they are already there."""
        group = node.data
        if group is None or node.children:
            return
        for child in group.children.values():
            node.add(self._label(child), data=child, allow_expand=bool(child.children))

    def _label(self, group: Group) -> Text:
        if group.tensor is not None and not group.children:
            entry = self._entries[group.tensor]
            shards = len(entry.shards)
            return Text.assemble(
                (group.name, "bold"), "  ", (entry.dtype, "magenta"), " ", shape_text(entry.shape), "  ",
                (human_bytes(entry.nbytes), "cyan"), "  ", (f"{shards} shard{'s' * (shards != 1)}", "dim"),
            )
        totals = f"{tensor_count(group.count)}, {human_bytes(group.nbytes)}"
        return Text.assemble((group.name, "bold"), "  ", (totals, "dim"))

    def on_tree_node_expanded(self, event: Tree.NodeExpanded[Group]) -> None:
        self._populate(event.node)
