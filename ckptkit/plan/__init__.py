"""Planning: pure functions from layouts to write items, read requests and the merged manifest."""
