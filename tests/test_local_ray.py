"""The local Ray that `python -m ray_resume.run` (and the test session) starts for itself."""

from __future__ import annotations

import ray
from ray.util.state import get_actor


@ray.remote(num_cpus=0)
class Probe:
    def state_of(self, actor_id: str) -> str:
        """What the state API, asked as Ray Train's placement-group cleaner asks it, says of an actor."""
        return get_actor(actor_id, timeout=5).state


def test_the_state_api_inside_the_job_answers_from_its_own_ray(ray_cluster):
    """Ray Train v2's placement-group cleaner polls the state API from inside the cluster; with no
    dashboard, or pointed at another (or a dead) Ray, each poll hangs and every fit() ended 12 s
    late. Inside our Ray it must answer, about an actor of this very Ray."""
    probe = Probe.remote()
    assert ray.get(probe.state_of.remote(probe._actor_id.hex())) == "ALIVE"
