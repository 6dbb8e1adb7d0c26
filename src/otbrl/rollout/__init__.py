"""otbrl.rollout"""
