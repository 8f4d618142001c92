"""``cdgpc-admin``: the command line for admins, researchers and scripts."""
