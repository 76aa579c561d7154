# Shared fixtures live in their own modules; this file only makes them visible to every test.
from tests.flow_fixtures import *  # noqa: F403
from tests.s3_fixtures import *  # noqa: F403
