-- job_submit.lua: slurm-cdgpc's submit-time check of `sbatch --comment=deadline=...` (Lua 5.1).
--
-- Install: copy to the directory of slurm.conf (/etc/slurm/job_submit.lua) and set
-- `JobSubmitPlugins=lua` in slurm.conf; `scontrol reconfigure` reloads it.
--
-- The grammar is the one of slurm_cdgpc/slurm/comment.py (the Prolog's parser; keep them equal):
--   tokens separated by commas or ASCII whitespace; `deadline=` ISO 8601
--   YYYY-MM-DD[THH:MM[:SS[.ffffff]]][Z|+HH|+HHMM|+HH:MM] (no zone: local time), `+` a span
--   (from submit; the span of slurm_cdgpc/units.py: one or more N[.F]{ms,s,m,min,h,d}, any case,
--   e.g. +6h, +90m, +1h30m), or epoch seconds; `iters=N`; `slo=p<percentile>:<latency>` (a
--   serving job's latency objective: percentile 50..99.99, latency N[.F]{us,ms,s} 1ms..600s,
--   e.g. slo=p99:250ms); keys, units and the p case-insensitive; anything else left alone.
-- A malformed value refuses the job with one line, e.g.
--   cdgpc: cannot read deadline 'tomorow': use 2026-12-01T12:00 or +6h
-- A deadline in the past or after the time limit is accepted with a warning.

local HINT = "use 2026-12-01T12:00 or +6h"
local MAX_EPOCH = 253402300799
local MAX_RELATIVE = 3650 * 86400
local MAX_ITERS = 9007199254740992
local UNIT = { ms = 0.001, s = 1, m = 60, min = 60, h = 3600, d = 86400 }
-- a latency's unit: its count per second (divided, so that 1000us is 1ms exactly)
local PER_SECOND = { us = 1e6, ms = 1e3, s = 1 }

local function clip(value)
	if #value > 43 then
		value = value:sub(1, 40) .. "..."
	end
	return (value:gsub("[%c\128-\255]", "?"))
end

-- seconds of a span like 90s, 1.5h, 1h30m or 250ms, or nil
local function parse_span(text)
	local seconds, rest = 0, text
	repeat
		local int, frac, unit, after = rest:match("^(%d+)(%.?%d*)[ \t]*(%a+)(.*)$")
		if not int or frac == "." or not UNIT[unit:lower()] then
			return nil
		end
		seconds, rest = seconds + tonumber(int .. frac) * UNIT[unit:lower()], after
	until rest == ""
	return seconds
end

local function bad_deadline(value)
	return nil, "cannot read deadline '" .. clip(value) .. "': " .. HINT
end

local function leap(y)
	return (y % 4 == 0 and y % 100 ~= 0) or y % 400 == 0
end

local function days_in(y, m)
	local days = { 31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31 }
	if m == 2 and leap(y) then
		return 29
	end
	return days[m]
end

-- seconds east of UTC of this machine's local time now
local function local_offset()
	local now = os.time()
	return os.difftime(now, os.time(os.date("!*t", now)))
end

local function parse_zone(rest)
	if rest == "" then
		return true, nil
	end
	if rest == "Z" then
		return true, 0
	end
	local sign, hh, mm = rest:match("^([+-])(%d%d):?(%d%d)$")
	if not sign then
		sign, hh = rest:match("^([+-])(%d%d)$")
		mm = "00"
	end
	if not sign or (rest:find(":") and #rest ~= 6) then
		return false
	end
	hh, mm = tonumber(hh), tonumber(mm)
	if hh > 23 or mm > 59 then
		return false
	end
	local offset = hh * 3600 + mm * 60
	if sign == "-" then
		offset = -offset
	end
	return true, offset
end

-- returns absolute epoch seconds, or relative seconds with is_relative = true, or nil, message
local function parse_deadline(value)
	local seconds = value:sub(1, 1) == "+" and parse_span(value:sub(2))
	if seconds then
		if seconds > MAX_RELATIVE then
			return nil, "deadline '" .. clip(value) .. "' is more than 3650 days away"
		end
		return seconds, nil, true
	end
	if value:match("^%d+$") then
		if #value > 12 or tonumber(value) > MAX_EPOCH then
			return bad_deadline(value)
		end
		return tonumber(value)
	end
	local y, mo, d, rest = value:match("^(%d%d%d%d)%-(%d%d)%-(%d%d)(.*)$")
	if not y then
		return bad_deadline(value)
	end
	local h, mi, s = 0, 0, 0
	local th, tmi, after = rest:match("^T(%d%d):(%d%d)(.*)$")
	if th then
		h, mi, rest = tonumber(th), tonumber(tmi), after
		local ts, after2 = rest:match("^:(%d%d)(.*)$")
		if ts then
			s, rest = tonumber(ts), after2
			local f, after3 = rest:match("^%.(%d+)(.*)$")
			if f then
				if #f > 6 then
					return bad_deadline(value)
				end
				rest = after3
			end
		end
	end
	y, mo, d = tonumber(y), tonumber(mo), tonumber(d)
	local ok, offset = parse_zone(rest)
	if not ok or y < 1 or mo < 1 or mo > 12 or d < 1 or d > days_in(y, mo) then
		return bad_deadline(value)
	end
	if h > 23 or mi > 59 or s > 59 then
		return bad_deadline(value)
	end
	local t = os.time({ year = y, month = mo, day = d, hour = h, min = mi, sec = s, isdst = nil })
	if t == nil then -- outside what this Lua's time_t holds: the value itself is fine
		return 0
	end
	if offset ~= nil then
		-- os.time read the fields as local time; shift to the given zone
		t = t + local_offset() - offset
	end
	return t
end

-- returns {percentile=, latency=} (seconds) of an slo= value like p99:250ms, or nil, message
local function parse_slo(value)
	local pint, pfrac, nint, nfrac, unit = value:match("^[pP](%d+)(%.?%d*):(%d+)(%.?%d*)(%a+)$")
	if not pint or pfrac == "." or nfrac == "." or not PER_SECOND[unit:lower()] then
		return nil, "cannot read slo '" .. clip(value) .. "': use slo=p99:250ms"
	end
	local percentile = tonumber(pint .. pfrac)
	if percentile < 50 or percentile > 99.99 then
		return nil, "slo percentile must be between 50 and 99.99, got p" .. clip(pint .. pfrac)
	end
	local latency = tonumber(nint .. nfrac) / PER_SECOND[unit:lower()]
	if latency < 0.001 or latency > 600 then
		return nil, "slo latency must be between 1ms and 600s, got " .. clip(nint .. nfrac .. unit)
	end
	return { percentile = percentile, latency = latency }
end

-- returns request {deadline=, relative=, iters=, slo=} or nil, message
local function parse_comment(text)
	local request = {}
	if text == nil then
		return request
	end
	for token in text:gmatch("[^,%s]+") do
		local key, value = token:match("^([^=]*)=(.*)$")
		if key then
			key = key:lower()
			if key == "deadline" then
				if request.deadline ~= nil then
					return nil, "deadline= is given twice in the comment"
				end
				local when, err, relative = parse_deadline(value)
				if when == nil then
					return nil, err
				end
				request.deadline, request.relative = when, relative
			elseif key == "iters" then
				if request.iters ~= nil then
					return nil, "iters= is given twice in the comment"
				end
				if not value:match("^%d+$") or #value > 16 then
					return nil,
						"cannot read iters '" .. clip(value) .. "': use a whole number like iters=50000"
				end
				local n = tonumber(value)
				if n < 1 or n > MAX_ITERS then
					return nil, "iters must be between 1 and " .. string.format("%.0f", MAX_ITERS) .. ", got " .. value
				end
				request.iters = n
			elseif key == "slo" then
				if request.slo ~= nil then
					return nil, "slo= is given twice in the comment"
				end
				local slo, err = parse_slo(value)
				if slo == nil then
					return nil, err
				end
				request.slo = slo
			end
		end
	end
	return request
end

function slurm_job_submit(job_desc, part_list, submit_uid)
	local request, err = parse_comment(job_desc.comment)
	if request == nil then
		slurm.log_user("cdgpc: %s", err)
		return slurm.ERROR
	end
	if request.deadline ~= nil then
		local now = os.time()
		local deadline = request.deadline
		if request.relative then
			deadline = now + deadline
		end
		if deadline <= now then
			slurm.log_user("cdgpc: warning: the deadline is in the past: the job runs at full speed")
		end
		local limit = job_desc.time_limit
		if limit ~= nil and limit ~= slurm.NO_VAL and limit ~= slurm.INFINITE and limit > 0 then
			if deadline > now + limit * 60 then
				slurm.log_user("cdgpc: warning: the deadline is after the time limit: Slurm ends the job first")
			end
		end
	end
	return slurm.SUCCESS
end

function slurm_job_modify(job_desc, job_rec, part_list, modify_uid)
	if job_desc.comment ~= nil then
		local request, err = parse_comment(job_desc.comment)
		if request == nil then
			slurm.log_user("cdgpc: %s", err)
			return slurm.ERROR
		end
	end
	return slurm.SUCCESS
end

return slurm.SUCCESS
