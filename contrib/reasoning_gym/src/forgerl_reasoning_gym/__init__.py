"""forgerl plugin: reasoning-gym (https://github.com/open-thought/reasoning-gym) procedural
tasks as a forgerl task, each scored by the dataset's own ``score_answer`` as a reward."""
