"""The doctor layer: what this machine and environment can do, judged against what the course needs. May import
the launch layer and everything below."""
