"""Result types: `HeadScores` / `HeadSet` and their text and notebook views."""
