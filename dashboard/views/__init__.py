"""One module per dashboard page; `common` holds what every page shares (run picking, notes)."""
