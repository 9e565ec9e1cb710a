"""Files that run on the remote host. They are sent over stdin, never imported there."""
