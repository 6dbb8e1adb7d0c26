"""otbrl.rewards"""
