"""The plugin contract and backend selection: hook specifications, plugin types, discovery, selection."""
