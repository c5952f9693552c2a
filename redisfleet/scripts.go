package redisfleet

import "github.com/redis/go-redis/v9"

// The shared breaker of a scope is one Redis hash, changed only by these
// scripts, so each change is atomic and timed by Redis's clock (TIME), not
// the replicas'. Fields:
//
//	st  "c" closed or "o" open (missing: closed)
//	f   consecutive failed calls, while closed
//	fs  when the first of them failed, ms on Redis's clock
//	u   end of the open period, ms on Redis's clock
//	g   generation: a new one at every open and close; the first is the
//	    time in ms, so a hash made again (after it expired, or Redis
//	    restarted) never reuses an older generation
//	p   probe leases granted in this round of the open period
//	s   probe successes in this round
//	r   round: a new one when every lease lapsed without a verdict
//	l   when the last lease lapses, ms
//
// Every script returns {state, remaining ms, generation}, state being
// "calm", "suspect", "open" or, from probe, "granted" (then a fourth
// value, the round) or "taken" (remaining: until the last lease lapses); a
// change is published on the fleet's channel as
// "scope\nstate\nremaining ms\ngeneration". Every write renews the hash's
// expiry, so the state of a fleet that stopped calling (a replica that
// died) expires.
const lib = `
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function num(k, field)
  return tonumber(redis.call('HGET', k, field) or '0') or 0
end

local function view(k, now)
  if redis.call('HGET', k, 'st') == 'o' then
    return {'open', math.max(num(k, 'u') - now, 0), num(k, 'g')}
  end
  if num(k, 'f') > 0 then
    return {'suspect', 0, num(k, 'g')}
  end
  return {'calm', 0, num(k, 'g')}
end

local function publish(k, now, channel, scope)
  local v = view(k, now)
  redis.call('PUBLISH', channel, scope .. '\n' .. v[1] .. '\n' .. v[2] .. '\n' .. v[3])
  return v
end

local function bump(k, now)
  if redis.call('HEXISTS', k, 'g') == 0 then
    redis.call('HSET', k, 'g', now)
  else
    redis.call('HINCRBY', k, 'g', 1)
  end
end

-- made (again) gives the hash a generation past every one it had before
-- it expired: replicas drop states of older generations than they saw.
local function made(k, now)
  if redis.call('HEXISTS', k, 'g') == 0 then
    redis.call('HSET', k, 'g', now)
  end
end

local function open(k, now, open_ms)
  redis.call('HSET', k, 'st', 'o', 'f', 0, 'u', now + open_ms, 'p', 0, 's', 0, 'l', 0)
  bump(k, now)
end

local function close(k, now)
  redis.call('HSET', k, 'st', 'c', 'f', 0, 'p', 0, 's', 0, 'l', 0)
  bump(k, now)
end
`

// ARGV of every script: channel, scope, ttl ms, threshold, open ms, max
// probes, down ms (breaker.Settings.DownAfter; 0: none); then the
// script's own.
const header = `
local k, channel, scope = KEYS[1], ARGV[1], ARGV[2]
local ttl, threshold, open_ms, max_probes = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local down_ms = tonumber(ARGV[7])
local now = now_ms()
`

var (
	// read returns the state.
	readScript = redis.NewScript(lib + header + `
return view(k, now)
`)

	// failed counts a failed call; the one that reaches the threshold,
	// down ms or more after the run's first failure, opens the breaker.
	// The first failure of a run makes the fleet suspect. A failure that
	// makes the hash again gives it a new generation.
	failedScript = redis.NewScript(lib + header + `
if redis.call('HGET', k, 'st') == 'o' then
  return view(k, now)
end
made(k, now)
local f = redis.call('HINCRBY', k, 'f', 1)
if f == 1 then
  redis.call('HSET', k, 'fs', now)
end
redis.call('PEXPIRE', k, ttl)
if f >= threshold and now - num(k, 'fs') >= down_ms then
  open(k, now, open_ms)
  redis.call('PEXPIRE', k, ttl)
  return publish(k, now, channel, scope)
end
if f == 1 then
  return publish(k, now, channel, scope)
end
return view(k, now)
`)

	// recovered ends the run of failures of a closed breaker.
	recoveredScript = redis.NewScript(lib + header + `
if redis.call('HGET', k, 'st') ~= 'o' and num(k, 'f') > 0 then
  redis.call('HSET', k, 'f', 0)
  redis.call('PEXPIRE', k, ttl)
  return publish(k, now, channel, scope)
end
return view(k, now)
`)

	// probe grants one of max_probes leases once the open period is over.
	// A replica that asks for one of a hash that expired gets the hash made
	// again, calm.
	// The leases lapse lease_ms (ARGV[8]) after the last was granted: then,
	// with no verdict in, a new round begins, so a probe whose replica died
	// frees the period, and a verdict of the old round counts for nothing.
	probeScript = redis.NewScript(lib + header + `
local lease_ms = tonumber(ARGV[8])
if redis.call('EXISTS', k) == 0 then
  -- The state expired (or Redis lost it) while a replica saw the fleet
  -- open: made again, calm, in a generation the replica takes.
  made(k, now)
  redis.call('PEXPIRE', k, ttl)
  return view(k, now)
end
if redis.call('HGET', k, 'st') ~= 'o' then
  return view(k, now)
end
if now < num(k, 'u') then
  return view(k, now)
end
local p = num(k, 'p')
if p >= max_probes and now >= num(k, 'l') then
  p = 0
  redis.call('HSET', k, 's', 0)
  redis.call('HINCRBY', k, 'r', 1)
end
if p >= max_probes then
  return {'taken', math.max(num(k, 'l') - now, 0), num(k, 'g')}
end
redis.call('HSET', k, 'p', p + 1, 'l', now + lease_ms)
redis.call('PEXPIRE', k, ttl)
return {'granted', 0, num(k, 'g'), num(k, 'r')}
`)

	// probeDone records a probe's verdict (ARGV[8] generation, ARGV[9]
	// round, ARGV[10] "s", "f" or "i"): max_probes successes close the
	// breaker, a failure opens it again, an ignored probe hands its lease
	// back. A verdict of another generation or round counts for nothing.
	probeDoneScript = redis.NewScript(lib + header + `
local gen, round, verdict = tonumber(ARGV[8]), tonumber(ARGV[9]), ARGV[10]
if redis.call('HGET', k, 'st') ~= 'o' or num(k, 'g') ~= gen or num(k, 'r') ~= round then
  return view(k, now)
end
redis.call('PEXPIRE', k, ttl)
if verdict == 'f' then
  open(k, now, open_ms)
  return publish(k, now, channel, scope)
end
if verdict == 'i' then
  redis.call('HSET', k, 'p', math.max(num(k, 'p') - 1, 0))
  return view(k, now)
end
local s = redis.call('HINCRBY', k, 's', 1)
if s >= max_probes then
  close(k, now)
  return publish(k, now, channel, scope)
end
return view(k, now)
`)
)
