"""The load path: lazy reads, mapped loads, load(into=), verify."""
