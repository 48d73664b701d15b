"""What a plan means for the fleet, beside the search: reduced clusters and objectives (tokens/s, dollars),
device prices, why devices are idle (measured), the precision the fleet trains in."""
