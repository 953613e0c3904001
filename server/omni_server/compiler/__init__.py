"""The repository room: stage folders on disk -> a typed, validated graph and process plan."""
