"""The tensor tree: keys grouped by their name path, populated lazily as nodes expand.

A 5,000-tensor checkpoint opens fast because only the top level is built at
first; the nested index itself is plain dicts, built in one pass over the keys.
Each tensor's recorded statistics (spec 6.10) show in its row: its norm, and in
red the NaN and infinite elements it holds; a group counts the tensors below it
that hold any, so that they can be found from the top of the tree.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from rich.style import Style
from rich.text import Text
from textual.widgets import Tree
from textual.widgets.tree import TreeNode

from ckptfmt.format.manifest import TensorEntry
from ckptfmt.tui.widgets.formatting import human_bytes, number, shape_text, split_key, tensor_count

EXPAND_ALL_BELOW = 200  # a filter matching fewer tensors than this opens every group


@dataclass
class Group:
    """One node of the name path: child groups, the tensor stored at this path (if any) and totals."""

    name: str
    children: dict[str, Group] = field(default_factory=dict)
    tensor: str | None = None
    count: int = 0
    nbytes: int = 0
    #: Tensors under this group holding NaN or infinite elements (by their recorded statistics).
    non_finite: int = 0


def non_finite_count(stats: Mapping | None) -> int:
    """NaN and infinite elements a tensor's recorded statistics count (0 when none are recorded)."""
    if not isinstance(stats, Mapping):
        return 0
    return sum(value for name in ("nan", "posinf", "neginf")
               if isinstance(value := stats.get(name), int) and not isinstance(value, bool))


def build_index(entries: list[TensorEntry]) -> Group:
    """Group tensors by the parts of their keys, counting tensors, bytes and tensors with non-finite
    elements under each group."""
    root = Group("")
    for entry in entries:
        bad = int(non_finite_count(entry.stats) > 0)
        node = root
        node.count += 1
        node.nbytes += entry.nbytes
        node.non_finite += bad
        for part in split_key(entry.key):
            node = node.children.setdefault(part, Group(part))
            node.count += 1
            node.nbytes += entry.nbytes
            node.non_finite += bad
        node.tensor = entry.key
    return root


class TensorTree(Tree[Group]):
    """A tree of tensor groups; a node's children are added the first time it expands."""

    def __init__(self, **kwargs) -> None:
        super().__init__("tensors", **kwargs)
        self.show_root = False
        self._entries: dict[str, TensorEntry] = {}

    def show(self, entries: list[TensorEntry]) -> None:
        """Replace the tree's content with ``entries``; opens every group when they are few, else the top ones.

        An entry that is the same tensor as an earlier one (``same_as``) shows that one's statistics."""
        entries = [e._replace(stats=entries[e.same_as].stats) if e.same_as is not None and e.same_as < len(entries)
                   else e for e in entries]
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
        """A group's or tensor's row; NaN/Inf counts come right after the name, so that a narrow tree
        cuts the sizes and norms before them."""
        label = Text.assemble((group.name, "bold"))
        if group.tensor is not None and not group.children:
            return label + _tensor_details(self._entries[group.tensor])
        if group.non_finite:
            label.append(f"  {tensor_count(group.non_finite)} with NaN/Inf", "bold red")
        label.append(f"  {tensor_count(group.count)}, {human_bytes(group.nbytes)}", "dim")
        return label

    def render_label(self, node: TreeNode[Group], base_style: Style, style: Style) -> Text:
        """The row's label, cut with an ellipsis where it would run past the tree's right edge (the detail
        pane shows all of it)."""
        label = super().render_label(node, base_style, style)
        width = self.size.width - self.styles.scrollbar_size_vertical  # room for a scrollbar, shown or not
        room = width - self.guide_depth * _depth(node)
        if width and label.cell_len > room:
            label.truncate(max(room, 1), overflow="ellipsis")
        return label

    def on_tree_node_expanded(self, event: Tree.NodeExpanded[Group]) -> None:
        self._populate(event.node)


def _tensor_details(entry: TensorEntry) -> Text:
    """What a tensor's row says after its name: NaN/Inf count, dtype, shape, size, norm, shards."""
    stats = entry.stats if isinstance(entry.stats, Mapping) else {}
    details = Text()
    bad = non_finite_count(stats)
    if bad:
        details.append(f"  {bad:,} NaN/Inf", "bold red")
    details.append_text(Text.assemble("  ", (entry.dtype, "magenta"), " ", shape_text(entry.shape), "  ",
                                      (human_bytes(entry.nbytes), "cyan")))
    if isinstance(stats.get("l2"), (int, float)):
        details.append(f"  ‖x‖ {number(stats['l2'])}", "green")
    shards = len(entry.shards)
    details.append(f"  {shards} shard{'s' * (shards != 1)}", "dim")
    return details


def _depth(node: TreeNode[Group]) -> int:
    """How many groups a node lies below the top level (the hidden root's children are at 0)."""
    depth = 0
    while node.parent is not None and node.parent.parent is not None:
        node, depth = node.parent, depth + 1
    return depth
