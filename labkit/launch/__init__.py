"""The launch layer: msrun jobs started, supervised and reported (the launcher, its checks, the all-reduce probe,
worker programs). May import the training layer and everything below."""
