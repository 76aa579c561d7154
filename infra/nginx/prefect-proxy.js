// What a credential may write, read from the request body: nginx's njs module (Debian's libnginx-mod-http-js),
// loaded by infra/nginx/prefect-proxy.conf for the routes whose body decides (docs/security.md, "The proxy").
//
//   runner  create_flow_run: parameters (no templates), a name, tags and a start time; the deployment's own
//           queue, retries and schema check. set_state: cancel a run that has not ended, retry one that failed,
//           crashed or was cancelled; the body is rebuilt, so `force`, `data` and the message are the proxy's.
//   box     only runs a worker holds (due in a pool, pending, running, cancelling, paused) or, for logs
//           and artifacts, ended a short while ago; never parameters, names of queues that do not exist, templates.
//   operator  everything; a state it sets by hand that fails, crashes, completes or cancels a run says who set it.
//
// The role and name come from nginx's `$datagen_who` ("role name", users.map); the route and method were already
// allowed for the role by the `$datagen_allowed` map. Requests this file lets through go on unchanged to the
// server (internalRedirect keeps the body nginx read); rebuilt ones go as subrequests.

const TERMINAL = ['COMPLETED', 'FAILED', 'CRASHED', 'CANCELLED'];
const HELD = ['PENDING', 'RUNNING', 'CANCELLING', 'PAUSED'];
const RETRYABLE = ['FAILED', 'CRASHED', 'CANCELLED'];
// Logs and artifacts a run writes reach the server in batches, some after its last state: this long after it.
const ENDED_GRACE_MS = 15 * 60 * 1000;
// A worker takes a scheduled run shortly before its start (PREFECT_WORKER_PREFETCH_SECONDS, 10 s by default):
// a run due within this long, or late, may be in a worker's hands; one due later is nobody's yet.
const DUE_MS = 5 * 60 * 1000;
// Prefect's own rule for names (prefect/types/names.py BANNED_CHARACTERS); the server answers 500 otherwise.
const BANNED_IN_NAMES = /[\/%&<>]/;
const RUNNER_RUN_NAME = /^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$/;
const TAG = /^[A-Za-z0-9][A-Za-z0-9._:-]{0,63}$/;
const MAX_TAGS = 20;
// Parameter values the server hydrates: "none" and "json" give back what was sent; "jinja" renders a template
// (its output has no size limit) and "workspace_variable" reads a variable: refused.
const HYDRATED_KINDS_ALLOWED = ['none', 'json'];
// What the UI's run form sends for a run's policy: Prefect's defaults, i.e. the flow's own retries.
const DEFAULT_POLICY = {
    max_retries: 0, retry_delay_seconds: 0, retries: null, retry_delay: null,
    pause_keys: [], resuming: false, retry_type: null,
};
const RUNNER_CREATE_FIELDS = ['parameters', 'name', 'tags', 'idempotency_key', 'state', 'work_queue_name',
    'empirical_policy', 'enforce_parameter_schema', 'job_variables'];
const BOX_CREATE_FIELDS = RUNNER_CREATE_FIELDS.concat(['context', 'labels', 'parent_task_run_id']);
const BOX_PATCH_FIELDS = ['flow_version', 'empirical_policy', 'infrastructure_pid', 'name'];

function Refusal(status, detail) {
    this.status = status;
    this.detail = detail;
}

function refuse(status, detail) {
    throw new Refusal(status, detail);
}

function who(r) {
    const parts = (r.variables.datagen_who || '').split(' ');
    return {role: parts[0], name: parts.slice(1).join(' ') || parts[0]};
}

function answer(r, status, text, type) {
    r.headersOut['Content-Type'] = type || 'application/json';
    r.return(status, text);
}

function isObject(v) {
    return v !== null && typeof v === 'object' && !Array.isArray(v);
}

function isEmpty(v) {
    return v === undefined || v === null || (isObject(v) && Object.keys(v).length === 0);
}

function body(r) {
    let parsed;
    try {
        parsed = JSON.parse(r.requestText || 'null');
    } catch (e) {
        refuse(422, 'the request body is not JSON');
    }
    return parsed;
}

function objectBody(r) {
    const parsed = body(r);
    if (parsed === null) {
        return {};
    }
    if (!isObject(parsed)) {
        refuse(422, 'the request body must be a JSON object');
    }
    return parsed;
}

// The server's answer to a read the proxy makes on the caller's behalf (with the upstream credential).
async function read(r, path) {
    const reply = await r.subrequest('/_datagen_read' + path, {method: 'GET'});
    if (reply.status === 404) {
        refuse(404, 'not found: ' + path);
    }
    if (reply.status !== 200) {
        refuse(502, 'prefect-proxy could not read ' + path + ' (' + reply.status + ')');
    }
    return JSON.parse(reply.responseText);
}

async function query(r, path, payload) {
    const reply = await r.subrequest('/_datagen_send' + path, {method: 'POST', body: JSON.stringify(payload)});
    if (reply.status !== 200) {
        refuse(502, 'prefect-proxy could not read ' + path + ' (' + reply.status + ')');
    }
    return JSON.parse(reply.responseText);
}

// Send `payload` instead of the request's own body, and give the caller the server's answer.
async function forward(r, payload) {
    const reply = await r.subrequest('/_datagen_send' + r.uri, {method: r.method, body: JSON.stringify(payload)});
    answer(r, reply.status, reply.responseText, reply.headersOut['Content-Type']);
}

function pass(r) {
    r.internalRedirect('@prefect');
}

function checkQueueName(name) {
    if (name === undefined || name === null) {
        return;
    }
    if (typeof name !== 'string' || name === '' || BANNED_IN_NAMES.test(name)) {
        refuse(422, 'work_queue_name ' + JSON.stringify(name) + ' is not a queue name (no / % & < >; Prefect\'s rule)');
    }
}

// Every value the server would hydrate, however deep (iteratively: a deep body cannot exhaust the stack).
function checkNoTemplates(parameters) {
    const stack = [parameters];
    while (stack.length) {
        const value = stack.pop();
        if (Array.isArray(value)) {
            for (let i = 0; i < value.length; i++) {
                stack.push(value[i]);
            }
        } else if (isObject(value)) {
            if (Object.prototype.hasOwnProperty.call(value, '__prefect_kind')
                    && HYDRATED_KINDS_ALLOWED.indexOf(value.__prefect_kind) < 0) {
                refuse(422, 'parameters may not hold "__prefect_kind": ' + JSON.stringify(value.__prefect_kind)
                    + ' (the server would render or look it up after its size check); send the value itself');
            }
            const keys = Object.keys(value);
            for (let i = 0; i < keys.length; i++) {
                stack.push(value[keys[i]]);
            }
        }
    }
}

function checkScheduledState(state) {
    if (state === undefined || state === null) {
        return;
    }
    if (!isObject(state) || state.type !== 'SCHEDULED') {
        refuse(403, 'a run starts Scheduled; its states are the worker\'s and the engine\'s to set (state.type '
            + JSON.stringify(isObject(state) ? state.type : state) + ')');
    }
    if (state.name !== undefined && state.name !== null && state.name !== 'Scheduled') {
        refuse(403, 'a new run\'s state is "Scheduled", not ' + JSON.stringify(state.name));
    }
    if (state.data !== undefined && state.data !== null) {
        refuse(403, 'a new run\'s state carries no data');
    }
    if (state.message !== undefined && state.message !== null
            && (typeof state.message !== 'string' || state.message.length > 500)) {
        refuse(422, 'state.message: a string of at most 500 characters');
    }
    const details = state.state_details;
    if (details === undefined || details === null) {
        return;
    }
    if (!isObject(details)) {
        refuse(422, 'state.state_details must be an object');
    }
    const keys = Object.keys(details);
    for (let i = 0; i < keys.length; i++) {
        const k = keys[i];
        const v = details[k];
        const free = (k === 'scheduled_time' || k === 'traceparent') && (v === null || typeof v === 'string');
        if (!free && v !== null && v !== false) {
            refuse(403, 'a new run\'s state_details.' + k + ' is not for its starter to set');
        }
    }
}

function checkPolicy(policy) {
    if (policy === undefined || policy === null) {
        return;
    }
    if (!isObject(policy)) {
        refuse(422, 'empirical_policy must be an object');
    }
    const keys = Object.keys(policy);
    for (let i = 0; i < keys.length; i++) {
        const k = keys[i];
        const v = policy[k];
        const wanted = DEFAULT_POLICY[k];
        const same = Array.isArray(wanted) ? Array.isArray(v) && v.length === 0
            : v === wanted || (wanted === null && v === 0) || (wanted === 0 && v === null);
        if (!Object.prototype.hasOwnProperty.call(DEFAULT_POLICY, k) || !same) {
            refuse(403, 'empirical_policy.' + k + ' ' + JSON.stringify(v) + ': a run gets its deployment\'s retries');
        }
    }
}

function checkFields(payload, allowed, role) {
    const keys = Object.keys(payload);
    for (let i = 0; i < keys.length; i++) {
        if (allowed.indexOf(keys[i]) < 0) {
            refuse(403, 'a ' + role + ' may not set ' + keys[i] + ' on a new run');
        }
    }
}

// A state an operator sets by hand that ends a run says who set it (the failure alert prints the message).
function stampedByHand(payload, caller) {
    const state = payload.state;
    if (!isObject(state) || TERMINAL.indexOf(state.type) < 0) {
        return null;
    }
    const note = 'set by hand by ' + caller.name + ' (operator)';
    const stamped = Object.assign({}, payload);
    stamped.state = Object.assign({}, state, {message: state.message ? note + ': ' + state.message : note});
    return stamped;
}

async function operatorStamp(r, caller) {
    if (r.method !== 'POST' || caller.role !== 'operator') {
        return pass(r);
    }
    const stamped = stampedByHand(objectBody(r), caller);
    return stamped ? forward(r, stamped) : pass(r);
}

async function createFlowRun(r, caller) {
    const payload = objectBody(r);
    checkQueueName(payload.work_queue_name);
    if (caller.role === 'operator') {
        return operatorStamp(r, caller);
    }
    checkFields(payload, caller.role === 'box' ? BOX_CREATE_FIELDS : RUNNER_CREATE_FIELDS, caller.role);
    if (payload.parameters !== undefined && payload.parameters !== null && !isObject(payload.parameters)) {
        refuse(422, 'parameters must be an object');
    }
    checkNoTemplates(payload.parameters);
    checkScheduledState(payload.state);
    checkPolicy(payload.empirical_policy);
    if (payload.enforce_parameter_schema !== undefined && payload.enforce_parameter_schema !== null
            && payload.enforce_parameter_schema !== true) {
        refuse(403, 'enforce_parameter_schema: the server checks every run\'s parameters against its deployment');
    }
    const deploymentId = r.uri.split('/')[3];
    const deployment = await read(r, '/api/deployments/' + deploymentId);
    // The server checks values against the schema, but lets names it does not list through (Prefect's flow
    // schemas say nothing of others): the run would then fail on the box.
    const schema = deployment.parameter_openapi_schema;
    if (isObject(schema) && isObject(schema.properties) && isObject(payload.parameters)) {
        const names = Object.keys(payload.parameters);
        for (let i = 0; i < names.length; i++) {
            if (!Object.prototype.hasOwnProperty.call(schema.properties, names[i])) {
                refuse(422, 'parameter ' + JSON.stringify(names[i]) + ' is not one of the deployment\'s ('
                    + Object.keys(schema.properties).join(', ') + ')');
            }
        }
    }
    const queue = payload.work_queue_name;
    if (queue !== undefined && queue !== null) {
        if (queue !== deployment.work_queue_name) {
            if (caller.role !== 'box' || !deployment.work_pool_name) {
                refuse(403, 'a runner\'s run goes to its deployment\'s queue ('
                    + JSON.stringify(deployment.work_queue_name) + '), not ' + JSON.stringify(queue));
            }
            // A multi-box parent puts each per-box run on that box's queue; it never creates one.
            const found = await r.subrequest('/_datagen_read/api/work_pools/'
                + encodeURIComponent(deployment.work_pool_name) + '/queues/' + encodeURIComponent(queue),
            {method: 'GET'});
            if (found.status !== 200) {
                refuse(403, 'work pool ' + deployment.work_pool_name + ' has no queue ' + JSON.stringify(queue)
                    + ': only an operator creates queues');
            }
        }
    }
    if (caller.role === 'box') {
        return pass(r);
    }
    if (payload.name !== undefined && payload.name !== null
            && (typeof payload.name !== 'string' || !RUNNER_RUN_NAME.test(payload.name))) {
        refuse(422, 'a run name is letters, digits, . _ - (at most 64, starting with a letter or digit)');
    }
    const tags = payload.tags === undefined || payload.tags === null ? [] : payload.tags;
    if (!Array.isArray(tags) || tags.length > MAX_TAGS) {
        refuse(422, 'tags: a list of at most ' + MAX_TAGS);
    }
    for (let i = 0; i < tags.length; i++) {
        if (typeof tags[i] !== 'string' || !TAG.test(tags[i])) {
            refuse(422, 'a tag is letters, digits, . _ : - (at most 64)');
        }
    }
    // Rebuilt from what was checked: the deployment's own queue, policy and schema check apply.
    const rebuilt = {parameters: payload.parameters || {}, tags: tags};
    if (typeof payload.name === 'string') {
        rebuilt.name = payload.name;
    }
    if (typeof payload.idempotency_key === 'string' && payload.idempotency_key.length <= 256) {
        rebuilt.idempotency_key = payload.idempotency_key;
    }
    if (!isEmpty(payload.job_variables)) {
        rebuilt.job_variables = payload.job_variables; // the pool's schema refuses any (422), as without the proxy
    }
    const state = payload.state;
    const when = isObject(state) && isObject(state.state_details) ? state.state_details.scheduled_time : null;
    rebuilt.state = {type: 'SCHEDULED', name: 'Scheduled', message: 'started by ' + caller.name + ' (runner)',
        state_details: typeof when === 'string' ? {scheduled_time: when} : {}};
    return forward(r, rebuilt);
}

function stateOf(run) {
    return run.state_type || (run.state && run.state.type) || null;
}

// Whether a worker may hold this run: pending, running, cancelling, paused, or scheduled and due (or late).
function held(run) {
    const now = stateOf(run);
    if (HELD.indexOf(now) >= 0) {
        return true;
    }
    const start = Date.parse(run.next_scheduled_start_time || run.expected_start_time || '');
    return now === 'SCHEDULED' && !isNaN(start) && start - Date.now() < DUE_MS;
}

function recently(run) {
    const stamp = run.state && run.state.timestamp ? Date.parse(run.state.timestamp) : NaN;
    return !isNaN(stamp) && Date.now() - stamp < ENDED_GRACE_MS;
}

function proposed(payload) {
    const state = payload.state;
    if (!isObject(state) || typeof state.type !== 'string') {
        refuse(422, 'set_state needs {"state": {"type": ...}}');
    }
    return state;
}

async function setState(r, caller) {
    const payload = objectBody(r);
    const state = proposed(payload);
    const runId = r.uri.split('/')[3];
    if (caller.role === 'operator') {
        return operatorStamp(r, caller);
    }
    const run = await read(r, '/api/flow_runs/' + runId);
    const now = stateOf(run);
    if (caller.role === 'box') {
        if (!held(run)) {
            refuse(409, 'run ' + runId + ' is ' + now + ': the box changes only runs a worker holds');
        }
        // A due run: a worker takes it (Pending), an engine starts its retry (Running), or it is cancelled.
        if (now === 'SCHEDULED' && ['PENDING', 'RUNNING', 'CANCELLING', 'CANCELLED'].indexOf(state.type) < 0) {
            refuse(409, 'run ' + runId + ' is Scheduled: a worker takes it, starts it or cancels it, nothing else');
        }
        return pass(r);
    }
    // A runner: cancel or retry, nothing else; the body is the proxy's, so force, data and message are ignored.
    if (state.type === 'CANCELLING' || state.type === 'CANCELLED') {
        if (TERMINAL.indexOf(now) >= 0) {
            refuse(409, 'run ' + runId + ' already ended (' + now + '): there is nothing to cancel');
        }
        return forward(r, {state: {type: 'CANCELLING', name: 'Cancelling',
            message: 'cancelled by ' + caller.name + ' (runner)'}, force: false});
    }
    if (state.type === 'SCHEDULED' && state.name === 'AwaitingRetry') {
        if (RETRYABLE.indexOf(now) < 0) {
            refuse(409, 'run ' + runId + ' is ' + now + ': only a failed, crashed or cancelled run is retried');
        }
        return forward(r, {state: {type: 'SCHEDULED', name: 'AwaitingRetry',
            message: 'retried by ' + caller.name + ' (runner)'}, force: false});
    }
    refuse(403, 'a runner cancels (CANCELLING) or retries (SCHEDULED "AwaitingRetry") a run; '
        + state.type + (state.name ? ' "' + state.name + '"' : '') + ' is the worker\'s and the engine\'s to set');
}

async function patchFlowRun(r, caller) {
    if (r.method !== 'PATCH' || caller.role !== 'box') {
        return pass(r);
    }
    const labels = r.uri.endsWith('/labels');
    const payload = labels ? body(r) : objectBody(r);
    if (!labels) {
        const keys = Object.keys(payload);
        for (let i = 0; i < keys.length; i++) {
            if (BOX_PATCH_FIELDS.indexOf(keys[i]) < 0) {
                refuse(403, 'the box may not change a run\'s ' + keys[i]);
            }
        }
    }
    const runId = r.uri.split('/')[3];
    const run = await read(r, '/api/flow_runs/' + runId);
    const now = stateOf(run);
    if (labels ? !held(run) : HELD.indexOf(now) < 0) {
        refuse(409, 'run ' + runId + ' is ' + now + ': the box changes only runs a worker holds');
    }
    return pass(r);
}

// Runs the box may write logs and artifacts for: held by a worker, or ended within ENDED_GRACE_MS.
async function checkRunsWritable(r, ids) {
    const unique = ids.filter((id, i) => ids.indexOf(id) === i);
    if (!unique.length) {
        return;
    }
    const runs = await query(r, '/api/flow_runs/filter', {flow_runs: {id: {any_: unique}}, limit: unique.length});
    const found = {};
    for (let i = 0; i < runs.length; i++) {
        found[runs[i].id] = runs[i];
    }
    for (let i = 0; i < unique.length; i++) {
        const run = found[unique[i]];
        if (!run) {
            refuse(403, 'no flow run ' + unique[i]);
        }
        const now = stateOf(run);
        if (!held(run) && !(TERMINAL.indexOf(now) >= 0 && recently(run))) {
            refuse(403, 'run ' + unique[i] + ' ended (' + now + '): the box writes only for runs a worker holds');
        }
    }
}

function runId(value, what) {
    if (value === undefined || value === null) {
        return null;
    }
    if (typeof value !== 'string' || !/^[0-9a-f-]{36}$/.test(value)) {
        refuse(422, what + ': flow_run_id must be a run id');
    }
    return value;
}

async function logs(r, caller) {
    if (caller.role !== 'box') {
        return pass(r);
    }
    const payload = body(r);
    if (!Array.isArray(payload)) {
        refuse(422, 'logs: a JSON list');
    }
    const ids = [];
    for (let i = 0; i < payload.length; i++) {
        const id = isObject(payload[i]) ? runId(payload[i].flow_run_id, 'logs') : null;
        if (id) {
            ids.push(id);
        }
    }
    await checkRunsWritable(r, ids);
    return pass(r);
}

async function artifacts(r, caller) {
    if (caller.role !== 'box') {
        return pass(r);
    }
    if (r.method === 'POST') {
        const id = runId(objectBody(r).flow_run_id, 'artifact');
        if (!id) {
            refuse(403, 'the box writes artifacts of its runs only (no flow_run_id)');
        }
        await checkRunsWritable(r, [id]);
        return pass(r);
    }
    // PATCH: the progress artifacts a running flow updates; nothing else of an artifact.
    const payload = objectBody(r);
    const keys = Object.keys(payload);
    for (let i = 0; i < keys.length; i++) {
        if (['data', 'description'].indexOf(keys[i]) < 0) {
            refuse(403, 'the box may not change an artifact\'s ' + keys[i]);
        }
    }
    const artifact = await read(r, '/api/artifacts/' + r.uri.split('/')[3]);
    if (artifact.type !== 'progress') {
        refuse(403, 'the box updates progress artifacts only; artifact ' + artifact.id + ' is ' + artifact.type);
    }
    const id = runId(artifact.flow_run_id, 'artifact');
    if (!id) {
        refuse(403, 'artifact ' + artifact.id + ' belongs to no run');
    }
    await checkRunsWritable(r, [id]);
    return pass(r);
}

const ROUTES = [
    [/^\/api\/deployments\/[0-9a-f-]{36}\/create_flow_run$/, createFlowRun],
    [/^\/api\/flow_runs\/[0-9a-f-]{36}\/set_state$/, setState],
    [/^\/api\/flow_runs\/[0-9a-f-]{36}(\/labels)?$/, patchFlowRun],
    [/^\/api\/flow_runs\/(bulk_set_state)?$/, operatorStamp],
    [/^\/api\/logs\/$/, logs],
    [/^\/api\/artifacts\/([0-9a-f-]{36})?$/, artifacts],
];

async function check(r) {
    const caller = who(r);
    try {
        for (let i = 0; i < ROUTES.length; i++) {
            if (ROUTES[i][0].test(r.uri)) {
                const handled = await ROUTES[i][1](r, caller);
                return handled;
            }
        }
        return pass(r);
    } catch (e) {
        if (e instanceof Refusal) {
            return answer(r, e.status, JSON.stringify({detail: e.detail + ' (prefect-proxy, ' + caller.role
                + '; docs/security.md)'}) + '\n');
        }
        r.error('prefect-proxy.js: ' + e);
        return answer(r, 500, JSON.stringify({detail: 'prefect-proxy could not check this request'}) + '\n');
    }
}

export default {check};
