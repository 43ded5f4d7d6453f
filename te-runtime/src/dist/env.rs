//! The launch environment of one process of a multi-process run, `torchrun`'s variables:
//! `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`. The same
//! variables describe one node or several (each node starts its processes with its own
//! `LOCAL_RANK`s; `RANK` is global), so multi-node runs need no other code.

use crate::{Error, Result};

/// Where this process stands in the run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DistEnv {
    /// Global rank, `0..world_size`.
    pub rank: usize,
    /// Processes in the run (all nodes).
    pub world_size: usize,
    /// Rank on this node: the GPU ordinal this process uses.
    pub local_rank: usize,
    /// Processes on this node.
    pub local_world_size: usize,
    /// Host of rank 0 (where the rendezvous listens).
    pub master_addr: String,
    /// Port of the rendezvous on `master_addr`.
    pub master_port: u16,
}

impl DistEnv {
    /// A single-process run: rank 0 of 1 (what a process launched without the variables is).
    pub fn single() -> Self {
        Self {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            master_addr: "127.0.0.1".into(),
            master_port: 29500,
        }
    }

    /// The environment of this process: [`DistEnv::from_vars`] over `std::env::var`.
    ///
    /// # Errors
    /// As [`DistEnv::from_vars`].
    pub fn from_env() -> Result<Option<Self>> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// The environment `var` gives: `None` when `WORLD_SIZE` is not set (a single-process run);
    /// else every variable parsed and checked. `LOCAL_RANK` defaults to `RANK` and
    /// `LOCAL_WORLD_SIZE` to `WORLD_SIZE` (one node), `MASTER_ADDR` to `127.0.0.1` and
    /// `MASTER_PORT` to 29500, as `torchrun` does.
    ///
    /// # Errors
    /// [`Error::DistEnv`] naming the variable: not a number, `WORLD_SIZE` 0, `RANK` missing or
    /// not below `WORLD_SIZE`, `LOCAL_RANK` not below `LOCAL_WORLD_SIZE`, a local world larger
    /// than the world, a port of 0 or above 65535.
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Option<Self>> {
        let Some(world) = var("WORLD_SIZE") else { return Ok(None) };
        let bad = |name: &str, message: String| Error::DistEnv { var: name.to_owned(), message };
        let number = |name: &str, text: &str| -> Result<usize> {
            text.trim().parse::<usize>().map_err(|_| bad(name, format!("`{text}` is not a non-negative integer")))
        };
        let world_size = number("WORLD_SIZE", &world)?;
        if world_size == 0 {
            return Err(bad("WORLD_SIZE", "0 processes: the run needs at least one".into()));
        }
        let rank = match var("RANK") {
            Some(r) => number("RANK", &r)?,
            None => {
                return Err(bad("RANK", format!("not set, with WORLD_SIZE = {world_size}: set each process's rank")))
            }
        };
        if rank >= world_size {
            return Err(bad("RANK", format!("{rank} is not below WORLD_SIZE = {world_size}")));
        }
        let local_rank = var("LOCAL_RANK").map(|r| number("LOCAL_RANK", &r)).transpose()?.unwrap_or(rank);
        let local_world_size =
            var("LOCAL_WORLD_SIZE").map(|r| number("LOCAL_WORLD_SIZE", &r)).transpose()?.unwrap_or(world_size);
        if local_world_size == 0 || local_world_size > world_size {
            return Err(bad(
                "LOCAL_WORLD_SIZE",
                format!("{local_world_size} processes on this node must be in [1, WORLD_SIZE = {world_size}]"),
            ));
        }
        if local_rank >= local_world_size {
            return Err(bad("LOCAL_RANK", format!("{local_rank} is not below LOCAL_WORLD_SIZE = {local_world_size}")));
        }
        let master_addr = var("MASTER_ADDR").map(|a| a.trim().to_owned()).unwrap_or_else(|| "127.0.0.1".into());
        if master_addr.is_empty() {
            return Err(bad("MASTER_ADDR", "empty: give rank 0's host name or address".into()));
        }
        let master_port = match var("MASTER_PORT") {
            None => 29500,
            Some(p) => match p.trim().parse::<u16>() {
                Ok(port) if port > 0 => port,
                _ => return Err(bad("MASTER_PORT", format!("`{p}` is not a port in [1, 65535]"))),
            },
        };
        Ok(Some(Self { rank, world_size, local_rank, local_world_size, master_addr, master_port }))
    }

    /// The variables that describe this process, for a launcher to set in a child's
    /// environment.
    pub fn vars(&self) -> [(&'static str, String); 6] {
        [
            ("RANK", self.rank.to_string()),
            ("LOCAL_RANK", self.local_rank.to_string()),
            ("WORLD_SIZE", self.world_size.to_string()),
            ("LOCAL_WORLD_SIZE", self.local_world_size.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn parse(vars: &[(&str, &str)]) -> Result<Option<DistEnv>> {
        let map: HashMap<String, String> = vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        DistEnv::from_vars(|k| map.get(k).cloned())
    }

    #[test]
    fn torchrun_variables_parse_with_its_defaults() {
        assert_eq!(parse(&[]).unwrap(), None, "no WORLD_SIZE: a single process");
        let e = parse(&[("WORLD_SIZE", "2"), ("RANK", "1")]).unwrap().unwrap();
        assert_eq!(e, DistEnv { rank: 1, world_size: 2, local_rank: 1, local_world_size: 2, ..DistEnv::single() });
        let vars = [
            ("WORLD_SIZE", "4"),
            ("RANK", "3"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", " node0 "),
            ("MASTER_PORT", "1234"),
        ];
        let e = parse(&vars).unwrap().unwrap();
        assert_eq!(
            (e.rank, e.local_rank, e.local_world_size, e.master_addr.as_str(), e.master_port),
            (3, 1, 2, "node0", 1234)
        );
        let back: Vec<(&str, String)> = e.vars().to_vec();
        let again = parse(&back.iter().map(|(k, v)| (*k, v.as_str())).collect::<Vec<_>>()).unwrap().unwrap();
        assert_eq!(again, e, "vars() round-trips");
    }

    #[test]
    fn bad_variables_are_typed_errors_naming_them() {
        for (vars, name, says) in [
            (vec![("WORLD_SIZE", "two"), ("RANK", "0")], "WORLD_SIZE", "not a non-negative integer"),
            (vec![("WORLD_SIZE", "0"), ("RANK", "0")], "WORLD_SIZE", "at least one"),
            (vec![("WORLD_SIZE", "2")], "RANK", "not set"),
            (vec![("WORLD_SIZE", "2"), ("RANK", "2")], "RANK", "not below WORLD_SIZE = 2"),
            (vec![("WORLD_SIZE", "2"), ("RANK", "-1")], "RANK", "not a non-negative integer"),
            (
                vec![("WORLD_SIZE", "2"), ("RANK", "0"), ("LOCAL_WORLD_SIZE", "3")],
                "LOCAL_WORLD_SIZE",
                "[1, WORLD_SIZE = 2]",
            ),
            (
                vec![("WORLD_SIZE", "4"), ("RANK", "0"), ("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "2")],
                "LOCAL_RANK",
                "not below",
            ),
            (vec![("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_PORT", "0")], "MASTER_PORT", "[1, 65535]"),
            (vec![("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_PORT", "70000")], "MASTER_PORT", "[1, 65535]"),
            (vec![("WORLD_SIZE", "2"), ("RANK", "0"), ("MASTER_ADDR", " ")], "MASTER_ADDR", "empty"),
        ] {
            let e = parse(&vars).unwrap_err();
            let text = e.to_string();
            assert!(matches!(&e, Error::DistEnv { var, .. } if var == name), "{vars:?}: {text}");
            assert!(text.contains(name) && text.contains(says), "{vars:?}: {text}");
        }
    }
}
