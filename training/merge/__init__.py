"""The syncer side: the merger (the I/O shell), its pure rules and streamed arithmetic, and the
syncer service that runs merge shards."""
