"""`pie serve --replicas N`: the server as a Ray Serve deployment, one engine, runtime and model
per replica, behind Ray Serve's HTTP proxy (docs/cluster.md). Ray is an optional extra
(`pip install -e '.[cluster]'`); nothing outside this package imports it."""
